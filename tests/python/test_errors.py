"""Bad input gives a clear Python exception, never a crash.

Every case asserts the exception type (a ``ringsplash.Error`` that is also a
``ValueError`` / ``TypeError``) and that the message names the offending
argument. The JAX front-end must reject bad shapes when the kernel is traced.
"""

import ml_dtypes
import numpy as np
import pytest

import ringsplash as rs
from ringsplash.masks import CausalMask, LocalMask, MultiHeadMask, NumpyMask

BF16 = ml_dtypes.bfloat16
B, S, H, HKV, D = 2, 32, 4, 2, 16


def _qkv(dtype=np.float32, Sq=S, Skv=S, h=H, hkv=HKV, d=D, dv=D):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, Sq, h, d)).astype(dtype),
            rng.standard_normal((B, Skv, hkv, d)).astype(dtype),
            rng.standard_normal((B, Skv, hkv, dv)).astype(dtype))


def _raises(exc, match, **kw):
    """attention(...) with q, k, v from _qkv() overridden by kw raises exc(match)."""
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises(exc, match=match) as info:
        rs.attention(args["q"], args["k"], args["v"], **kw)
    assert isinstance(info.value, rs.Error), type(info.value)
    return info.value


def test_exception_hierarchy():
    assert issubclass(rs.InvalidArgumentError, rs.Error)
    assert issubclass(rs.InvalidArgumentError, ValueError)
    assert issubclass(rs.DTypeError, rs.Error)
    assert issubclass(rs.DTypeError, TypeError)


# ----------------------------------------------------------------------------- ranks and shapes

@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(which):
    q, k, v = _qkv()
    x = dict(q=q, k=k, v=v)[which]
    _raises(rs.InvalidArgumentError, rf"\b{which}\b", **{which: x[0]})          # 3-D
    _raises(rs.InvalidArgumentError, rf"\b{which}\b", **{which: x[None]})       # 5-D


@pytest.mark.parametrize("which,dtype", [
    ("q", np.float64), ("k", np.float64), ("v", np.float64), ("q", np.int32), ("q", np.bool_),
    ("q", np.complex64),
])
def test_unsupported_dtype(which, dtype):
    q, k, v = _qkv()
    x = dict(q=q, k=k, v=v)[which].astype(dtype)
    _raises(rs.DTypeError, rf"\b{which}\b|{np.dtype(dtype).name}", **{which: x})


def test_float64_everywhere_is_a_dtype_error():
    q, k, v = _qkv(np.float64)
    with pytest.raises(TypeError, match="float64"):
        rs.attention(q, k, v)


def test_mixed_dtypes():
    # A supported dtype that differs from q's: the message names the argument and q's dtype.
    q, k, v = _qkv()
    _raises((rs.DTypeError, rs.InvalidArgumentError), r"\bk\b.*dtype", k=k.astype(BF16))
    _raises((rs.DTypeError, rs.InvalidArgumentError), r"\bv\b.*dtype", v=v.astype(BF16))


def test_mismatched_shapes():
    q, k, v = _qkv()
    _raises(rs.InvalidArgumentError, r"\bk\b", k=k[..., :8])            # D differs from q
    _raises(rs.InvalidArgumentError, r"\bv\b", v=v[:, :16])             # Skv differs from k
    _raises(rs.InvalidArgumentError, r"\b[kv]\b", k=k[:1], v=v[:1])     # batch differs from q
    _raises(rs.InvalidArgumentError, r"\bv\b", v=v[:, :, :1])           # Hkv differs from k


def test_heads_not_divisible():
    q, k, v = _qkv(h=4, hkv=3)
    with pytest.raises(rs.InvalidArgumentError, match=r"\bk\b.*H.*dividing H=4"):
        rs.attention(q, k, v)


def test_head_dim_too_large():
    q, k, v = _qkv(d=300, dv=16)
    with pytest.raises(rs.InvalidArgumentError, match=r"\b[qk]\b.*256|head dim"):
        rs.attention(q, k, v)


def test_empty_sequence_is_an_error_or_empty_result():
    q, k, v = _qkv(Sq=0)
    try:
        out = rs.attention(q, k, v)
    except rs.InvalidArgumentError:
        return
    assert out.shape == (B, 0, H, D)


# ----------------------------------------------------------------------------- masks

def test_mask_shape_mismatch():
    _raises(rs.InvalidArgumentError, "mask", mask=CausalMask((16, 16)))
    _raises(rs.InvalidArgumentError, "mask", mask=LocalMask((S, S + 1), (4, 0)))
    _raises(rs.InvalidArgumentError, "mask", mask=NumpyMask(np.ones((S, 2 * S), bool)))


def test_multihead_mask_with_wrong_head_count():
    m = MultiHeadMask([CausalMask((S, S))] * (H + 1))
    _raises(rs.InvalidArgumentError, "mask|head", mask=m)


def test_combined_masks_of_different_shapes():
    with pytest.raises(rs.InvalidArgumentError, match="shape"):
        CausalMask((S, S)) & CausalMask((S, 2 * S))
    with pytest.raises(rs.InvalidArgumentError, match="shape"):
        CausalMask((S, S)) | LocalMask((2 * S, S), (1, 1))


def test_bad_mask_text():
    e = _raises(rs.InvalidArgumentError, "banana", mask="causal & banana")
    assert "mask" in str(e).lower() or "term" in str(e).lower()
    _raises(rs.InvalidArgumentError, "mask|local|expected", mask="local:")


def test_bad_mask_objects():
    with pytest.raises((rs.InvalidArgumentError, rs.DTypeError), match="(?i)mask|shape|2-D|bool"):
        NumpyMask(np.ones((2, 3, 4, 5), bool))
    with pytest.raises(rs.InvalidArgumentError, match="chunk"):
        from ringsplash.masks import ChunkedCausalMask
        ChunkedCausalMask((S, S), 0)
    with pytest.raises((rs.Error, TypeError), match="mask"):
        rs.attention(*_qkv(), mask=3.5)


# ----------------------------------------------------------------------------- other arguments

@pytest.mark.parametrize("bs", [(0, 128), (128, -16), (17, 128), (128, 8)])
def test_bad_block_sizes(bs):
    _raises(rs.InvalidArgumentError, "(?i)block", block_sizes=bs)


def test_bad_num_threads():
    _raises(rs.InvalidArgumentError, "(?i)thread", num_threads=-1)
    _raises(rs.InvalidArgumentError, "(?i)thread", num_threads=10**6)


def test_segments_for_one_side_only():
    seg = np.zeros((B, S), np.int32)
    _raises(rs.InvalidArgumentError, "segment", q_segment_ids=seg)
    _raises(rs.InvalidArgumentError, "segment", kv_segment_ids=seg)


def test_segments_of_wrong_shape_or_type():
    seg = np.zeros((B, S), np.int32)
    _raises(rs.InvalidArgumentError, "segment", q_segment_ids=seg[:, :8], kv_segment_ids=seg)
    _raises(rs.InvalidArgumentError, "segment", q_segment_ids=seg, kv_segment_ids=seg[:1])
    with pytest.raises((rs.InvalidArgumentError, rs.DTypeError), match="segment"):
        q, k, v = _qkv()
        rs.attention(q, k, v, q_segment_ids=seg.astype(np.float32), kv_segment_ids=seg)


def test_bad_sinks():
    _raises(rs.InvalidArgumentError, "sinks", sinks=np.zeros(H + 1, np.float32))
    _raises(rs.InvalidArgumentError, "sinks", sinks=np.zeros((H, 2), np.float32))


def test_bad_soft_cap_and_scale():
    _raises(rs.InvalidArgumentError, "(?i)cap", logits_soft_cap=0.0)
    _raises(rs.InvalidArgumentError, "(?i)cap", logits_soft_cap=-1.0)
    _raises(rs.InvalidArgumentError, "(?i)scale", scale=float("nan"))


def test_non_array_inputs_are_rejected_cleanly():
    q, k, v = _qkv()
    with pytest.raises(rs.Error, match=r"\bq\b"):
        rs.attention("q", k, v)
    with pytest.raises(rs.Error, match=r"\bk\b"):
        rs.attention(q, None, v)


# ----------------------------------------------------------------------------- backward

def _fwd():
    q, k, v = _qkv()
    out, lse = rs.attention(q, k, v, mask="causal", return_lse=True)
    return q, k, v, out, lse, np.ones_like(out)


def test_backward_bad_shapes():
    q, k, v, out, lse, dout = _fwd()
    with pytest.raises(rs.InvalidArgumentError, match=r"\bout\b"):
        rs.attention_backward(q, k, v, out[:, :8], lse, dout, mask="causal")
    with pytest.raises(rs.InvalidArgumentError, match=r"\blse\b"):
        rs.attention_backward(q, k, v, out, lse[:, :, :8], dout, mask="causal")
    with pytest.raises(rs.InvalidArgumentError, match=r"\bdout\b"):
        rs.attention_backward(q, k, v, out, lse, dout[:, :, :2], mask="causal")
    with pytest.raises(rs.InvalidArgumentError, match="mask"):
        rs.attention_backward(q, k, v, out, lse, dout, mask=CausalMask((8, 8)))


def test_backward_bad_dtypes():
    q, k, v, out, lse, dout = _fwd()
    with pytest.raises(rs.DTypeError, match=r"\blse\b|float64"):
        rs.attention_backward(q, k, v, out, lse.astype(np.float64), dout)
    with pytest.raises(rs.DTypeError, match=r"\bdout\b|float64"):
        rs.attention_backward(q, k, v, out, lse, dout.astype(np.float64))


# ----------------------------------------------------------------------------- JAX

def test_jax_kernel_rejects_bad_shapes_at_trace_time():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from ringsplash.jax import make_splash_attention

    kernel = make_splash_attention(CausalMask((S, S)))
    q, k, v = (jnp.asarray(x) for x in _qkv())
    with pytest.raises(ValueError, match="mask"):
        jax.jit(kernel).lower(q[:, :16], k[:, :16], v[:, :16])   # mask (32, 32) vs S = 16
    with pytest.raises(ValueError, match=r"\bk\b"):
        kernel(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"\bq\b"):
        kernel(q[0], k, v)
    with pytest.raises(ValueError, match=r"\bk\b.*dividing H=3"):
        kernel(jnp.zeros((B, S, 3, D)), k, v)
    with pytest.raises(ValueError, match="sinks"):
        kernel(q, k, v, sinks=jnp.zeros(H + 2))
    seg = jnp.zeros((B, S), jnp.int32)
    from ringsplash import SegmentIds
    with pytest.raises(ValueError, match="segment"):
        kernel(q, k, v, segment_ids=SegmentIds(seg[:, :4], seg))
    with pytest.raises(TypeError):
        kernel(q.astype(jnp.int32), k, v)


def test_jax_bad_block_sizes_are_a_value_error():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from ringsplash.jax import make_splash_attention

    q, k, v = (jnp.asarray(x) for x in _qkv())
    with pytest.raises(ValueError, match="block"):
        make_splash_attention(CausalMask((S, S)), block_sizes=(0, 128))(q, k, v)

"""ringsplash.attention / attention_backward (NumPy) against the f64 reference.

Every numeric check compares with ``ringsplash.reference`` (float64, written
from SPEC §2-3 independently of the C++ code), run on the *same* values the
kernels were given (for bf16 / f16: the rounded inputs converted exactly to
float64), so input rounding is never counted as kernel error.

Tolerances (errors are absolute, checked elementwise; measured margins are
for the avx512_bf16 kernel path of the development machine):

* f32, out: every out element is a convex combination of rows of v (the
  sink's share contributes nothing), so its error is at most (relative error
  of the probabilities + roundoff of the f32 sum) * max|v|. The probabilities
  carry the logit error (a D-term f32 dot product, D <= 64, then exp) and the
  sums run over Skv <= 128 keys: worst case of order (D + Skv) * 2^-24 ~ 1e-5,
  typically far less because rounding errors are random. Bound
  1e-5 * max|v| (measured: <= 0.06 of it). A wrong mask element or GQA head
  moves out by O(1e-2) * max|v|.
* f32, lse: the same relative error of the softmax denominator is an absolute
  error of lse: 1e-5 * max(1, max|lse|).
* f32, gradients: dq, dk, dv are sums over <= 128 (x the GQA group) products
  of f32 quantities p, ds = p (dp - D), dout, k, q, each with the forward's
  relative error; relative to the largest element of the reference gradient:
  2e-5 (measured: <= 0.05 of it). dsinks[h] = -sum_{b,i} exp(sink - lse_i) D_i
  adds B * Sq terms: 2e-5 * sum_{b,i} |exp(sink - lse_i) D_i|.
* bf16 / f16 inputs: the reference runs on the same (rounded) values, so only
  the kernels' own error counts. Products of 16-bit values are exact in f32
  and accumulation is f32, except that the AVX512-BF16 / AMX paths round the
  probabilities P (and dS in the backward) to bf16, u = 2^-8 relative per
  element, before their tile products: |d out_i| <= u * sum_j p_ij |v_j| <=
  u * max|v|. The result is then stored in q's dtype: half an ulp, 2^-9 (bf16)
  or 2^-12 (f16) relative to the element. Bound for out:
  (u + 1e-5) * max|v| + 2^-9 * |ref| elementwise (measured <= 0.43 of it).
  lse is f32, from unrounded P: the f32 bound.
  Gradients: the backward is given the reference's out (stored as bf16) and
  lse, as the C++ accuracy tests do, so that the forward's P rounding does
  not enter D = dout . out. Rounding P and dS to bf16 perturbs each product of
  the sums by <= u relative, so |d dq| <= u * scale * sum_j |ds_ij| |k_j|
  (dk, dv alike); for these random inputs those sums of |terms| are a small
  multiple of max|gradient| (cancellation in ds = p (dp - D)). Bound:
  2^-6 * max|reference gradient| + 2^-9 * |ref| elementwise for the storage
  rounding (measured: <= 0.51 of it, the MQA case where dk sums 4 heads).
  dsinks (f32, from the stored out): 2^-7 * sum |exp(sink - lse) D|.
"""

import zlib

import ml_dtypes
import numpy as np
import pytest

import ringsplash as rs
from ringsplash import reference as R
from ringsplash.masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask, MultiHeadMask,
                              NumpyMask)
from checks import assert_close as _assert_close  # noqa: E402
from checks import f64 as _f64  # noqa: E402

BF16 = ml_dtypes.bfloat16
F32_OUT = 1e-5
F32_GRAD = 2e-5
GRAD_LOW = 2.0**-6
STORAGE_ROUNDING = {np.dtype(np.float32): 0.0, np.dtype(BF16): 2.0**-9,
                    np.dtype(np.float16): 2.0**-12}


def _make(rng, B=2, Sq=64, Skv=64, H=4, Hkv=2, D=32, Dv=32, dtype=np.float32, qscale=1.5):
    """Random q, k, v, dout in `dtype` and their exact float64 values."""
    def r(*shape, s=1.0):
        return (s * rng.standard_normal(shape)).astype(dtype)
    q = r(B, Sq, H, D, s=qscale)  # logits of O(1..10): the softmax is far from uniform
    k = r(B, Skv, Hkv, D)
    v = r(B, Skv, Hkv, Dv)
    dout = r(B, Sq, H, Dv)
    return q, k, v, dout





_SAME = object()


def _run(q, k, v, dout, *, mask=None, ref_mask=_SAME, check_backward=True, api_kw=None,
         own_out=False, **kw):
    """Forward and backward through the NumPy API, checked against the reference.

    ``mask`` goes to ringsplash, ``ref_mask`` (default: the same object) to the
    reference; ``kw`` (scale, soft cap, sinks, segments) go to both. For 16-bit
    inputs the backward is given the reference's out and lse unless
    ``own_out`` (then the kernel's own forward results, as a user would).
    """
    api_kw = api_kw or {}
    ref_mask = mask if ref_mask is _SAME else ref_mask
    dt = np.dtype(q.dtype)
    low = dt != np.float32
    out, lse = rs.attention(q, k, v, mask=mask, return_lse=True, **kw, **api_kw)
    assert out.dtype == dt and out.shape == q.shape[:3] + (v.shape[3],)
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    rkw = dict(kw)
    rkw.pop("sinks", None)
    sinks = kw.get("sinks")
    ro, rl = R.attention_reference(_f64(q), _f64(k), _f64(v), mask=ref_mask, sinks=_f64(sinks),
                                   **rkw)
    vmax = np.abs(_f64(v)).max()
    u_out = STORAGE_ROUNDING[dt]
    u_p = 2.0**-8 if low else 0.0
    _assert_close("out", out, ro, atol=(u_p + F32_OUT) * vmax * (1 + u_out), rtol=u_out)
    lse_max = np.abs(rl[np.isfinite(rl)]).max(initial=0)
    _assert_close("lse", lse, rl, atol=F32_OUT * max(1.0, lse_max))
    if not check_backward:
        return out, lse
    if low and not own_out:
        # As the C++ accuracy tests do: the backward gets the reference's out (stored in
        # q's dtype) and lse, so the forward's P rounding does not enter D = dout . out.
        bout, blse = ro.astype(dt), rl.astype(np.float32)
    else:
        bout, blse = out, lse
    grads = rs.attention_backward(q, k, v, bout, blse, dout, mask=mask, **kw, **api_kw)
    dq, dk, dv, dsinks = grads
    rg = R.attention_backward_reference(_f64(q), _f64(k), _f64(v), _f64(dout), mask=ref_mask,
                                        sinks=_f64(sinks), **rkw)
    rel = GRAD_LOW if low else F32_GRAD
    for name, got, want, x in zip(("dq", "dk", "dv"), (dq, dk, dv), rg[:3], (q, k, v)):
        assert got.dtype == dt and got.shape == x.shape, name
        _assert_close(name, got, want, atol=rel * np.abs(want).max(), rtol=u_out)
    if sinks is None:
        assert dsinks is None
    else:
        assert dsinks.dtype == np.float32 and dsinks.shape == (q.shape[2],)
        D = np.einsum("bqhd,bqhd->bhq", _f64(dout), ro)
        s64 = _f64(sinks)[None, :, None]
        fin = np.isfinite(rl) & np.isfinite(s64)
        terms = np.where(fin, np.exp(np.where(fin, s64 - np.where(fin, rl, 0), 0)), 0) * np.abs(D)
        _assert_close("dsinks", dsinks, rg[3],
                      atol=(2.0**-7 if low else F32_GRAD) * terms.sum() + 1e-7)
    return out, lse, grads


# ----------------------------------------------------------------------------- masks

S = 64


def _mask_cases():
    sh = (S, S)
    rng = np.random.default_rng(123)
    dense = rng.random(sh) < 0.3
    dense[5] = False  # a row with no key
    causal = CausalMask(sh)
    return {
        "none": None,
        "full": FullMask(sh),
        "causal": causal,
        "causal_offset_pos": CausalMask(sh, offset=5),
        "causal_offset_neg": CausalMask(sh, offset=-7),  # first 7 rows have no key
        "local_both": LocalMask(sh, window_size=(6, 3)),
        "local_left_only": LocalMask(sh, window_size=(5, None)),
        "local_right_only": LocalMask(sh, window_size=(None, 4)),
        "local_offset": LocalMask(sh, window_size=(3, 2), offset=-10),
        "chunked": ChunkedCausalMask(sh, chunk_size=16),
        "chunked_odd": ChunkedCausalMask(sh, chunk_size=7),
        "numpy": NumpyMask(dense),
        "and": causal & LocalMask(sh, window_size=(9, 0)),
        "or": ChunkedCausalMask(sh, chunk_size=8) | LocalMask(sh, window_size=(2, 2)),
        "nested": (causal | LocalMask(sh, window_size=(0, 3))) & ChunkedCausalMask(sh, 32),
        "numpy_and_causal": NumpyMask(rng.random(sh) < 0.5) & causal,
        "multihead": MultiHeadMask([causal, LocalMask(sh, (4, 4)), ChunkedCausalMask(sh, 8),
                                    NumpyMask(dense)]),
    }


MASKS = _mask_cases()


@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask_f32(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2)
    _run(q, k, v, dout, mask=MASKS[name])


@pytest.mark.parametrize("name", ["causal", "local_both", "chunked", "numpy", "or", "multihead"])
def test_masks_bf16(name):
    rng = np.random.default_rng(7)
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2, dtype=BF16)
    _run(q, k, v, dout, mask=MASKS[name])


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
def test_low_precision_backward_from_its_own_forward(dtype):
    """The user's chain: attention_backward gets the kernel's own (rounded) out."""
    rng = np.random.default_rng(8)
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2, dtype=dtype)
    _run(q, k, v, dout, mask=MASKS["nested"], own_out=True,
         sinks=np.array([1, 0, -1, 2], np.float32))


@pytest.mark.parametrize("text,obj", [
    ("causal", lambda sh: CausalMask(sh)),
    ("full", lambda sh: FullMask(sh)),
    ("causal:3", lambda sh: CausalMask(sh, offset=3)),
    ("local:8,0", lambda sh: LocalMask(sh, (8, 0))),
    ("local:,2", lambda sh: LocalMask(sh, (None, 2))),
    ("local:4,4,-6", lambda sh: LocalMask(sh, (4, 4), offset=-6)),
    ("chunked:16", lambda sh: ChunkedCausalMask(sh, 16)),
    ("causal & local:8,", lambda sh: CausalMask(sh) & LocalMask(sh, (8, None))),
    ("chunked:8 | local:3,0", lambda sh: ChunkedCausalMask(sh, 8) | LocalMask(sh, (3, 0))),
    ("(causal | local:4,4) & chunked:32",
     lambda sh: (CausalMask(sh) | LocalMask(sh, (4, 4))) & ChunkedCausalMask(sh, 32)),
])
def test_mask_text(text, obj):
    rng = np.random.default_rng(11)
    q, k, v, dout = _make(rng, Sq=S, Skv=S)
    _run(q, k, v, dout, mask=text, ref_mask=obj((S, S)))


def test_mask_is_reusable_across_calls_and_shapes_of_batch():
    rng = np.random.default_rng(12)
    m = CausalMask((S, S)) & LocalMask((S, S), (10, 0))
    for B in (1, 3, 1):
        q, k, v, dout = _make(rng, B=B, Sq=S, Skv=S, H=2, Hkv=1)
        _run(q, k, v, dout, mask=m)


# ----------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_gqa_mqa(H, Hkv, dtype):
    rng = np.random.default_rng(H * 10 + Hkv)
    q, k, v, dout = _make(rng, Sq=48, Skv=48, H=H, Hkv=Hkv, D=16, Dv=16, dtype=dtype)
    _run(q, k, v, dout, mask=LocalMask((48, 48), (12, 0)))


@pytest.mark.parametrize("D,Dv", [(32, 16), (16, 48), (64, 8)])
def test_dv_differs_from_d(D, Dv):
    rng = np.random.default_rng(D + Dv)
    q, k, v, dout = _make(rng, Sq=40, Skv=40, D=D, Dv=Dv)
    _run(q, k, v, dout, mask=CausalMask((40, 40)))


@pytest.mark.parametrize("Sq,Skv,make_mask", [
    (32, 96, lambda a, b: CausalMask((a, b), offset=b - a)),  # bottom-right aligned (decode)
    (96, 32, lambda a, b: CausalMask((a, b), offset=b - a)),  # first 64 rows empty
    (40, 104, lambda a, b: LocalMask((a, b), (16, 0), offset=b - a)),
    (48, 80, lambda a, b: ChunkedCausalMask((a, b), 24) | LocalMask((a, b), (0, 5), offset=20)),
    (17, 33, lambda a, b: FullMask((a, b))),
    (1, 128, lambda a, b: CausalMask((a, b), offset=b - 1)),  # one decoding step
    (33, 17, lambda a, b: NumpyMask(np.random.default_rng(1).random((a, b)) < 0.4)),
])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_sq_differs_from_skv(Sq, Skv, make_mask, dtype):
    rng = np.random.default_rng(Sq * 1000 + Skv)
    q, k, v, dout = _make(rng, Sq=Sq, Skv=Skv, H=4, Hkv=1, D=32, Dv=24, dtype=dtype)
    _run(q, k, v, dout, mask=make_mask(Sq, Skv))


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_dtypes_and_soft_cap(dtype, cap):
    rng = np.random.default_rng(21)
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2, dtype=dtype, qscale=3.0)
    _run(q, k, v, dout, mask=CausalMask((S, S)), logits_soft_cap=cap)


def test_explicit_scale():
    rng = np.random.default_rng(22)
    q, k, v, dout = _make(rng, Sq=S, Skv=S)
    _run(q, k, v, dout, mask=CausalMask((S, S)), scale=0.05)
    _run(q, k, v, dout, mask=None, scale=0.4, logits_soft_cap=5.0)


# ----------------------------------------------------------------------------- sinks, segments

@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_sinks(dtype):
    rng = np.random.default_rng(31)
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2, dtype=dtype)
    sinks = np.array([0.5, -1.0, 3.0, -80.0], np.float32)  # -80: a negligible sink
    m = CausalMask((S, S), offset=-3)  # rows 0..2 have only the sink
    out, lse, grads = _run(q, k, v, dout, mask=m, sinks=sinks, logits_soft_cap=4.0)
    np.testing.assert_array_equal(out[:, :3].astype(np.float32), 0)
    np.testing.assert_array_equal(lse[:, :, :3], np.broadcast_to(sinks[:, None], (2, 4, 3)))


def test_minus_inf_sink_is_no_sink():
    rng = np.random.default_rng(32)
    q, k, v, dout = _make(rng, Sq=32, Skv=32, H=4, Hkv=2)
    sinks = np.array([0.5, -np.inf, 1.0, -np.inf], np.float32)
    m = CausalMask((32, 32), offset=-3)  # rows 0..2: no key; heads 1, 3: no sink either
    out, lse, grads = _run(q, k, v, dout, mask=m, sinks=sinks)
    assert np.all(lse[:, 1, :3] == -np.inf) and np.all(lse[:, 3, :3] == -np.inf)
    assert grads[3][1] == 0 and grads[3][3] == 0


def _segments(B, Sq, Skv):
    """Packed documents; query document 9 has no keys (out 0, lse -inf)."""
    qs = np.zeros((B, Sq), np.int32)
    ks = np.zeros((B, Skv), np.int32)
    qs[:, Sq // 3:] = 1
    ks[:, Skv // 4:] = 1
    qs[:, 2 * Sq // 3:] = 2
    ks[:, Skv // 2:] = 2
    qs[0, -5:] = 9  # no key is in document 9
    ks[1, :] = np.sort(np.random.default_rng(0).integers(0, 3, Skv)).astype(np.int32)
    return qs, ks


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mask", ["causal", None, "local:10,0"])
def test_segments_with_an_empty_query_document(dtype, mask):
    rng = np.random.default_rng(41)
    q, k, v, dout = _make(rng, Sq=S, Skv=S, H=4, Hkv=2, dtype=dtype)
    qs, ks = _segments(2, S, S)
    ref_mask = {"causal": CausalMask((S, S)), None: None,
                "local:10,0": LocalMask((S, S), (10, 0))}[mask]
    out, lse, (dq, dk, dv, _) = _run(q, k, v, dout, mask=mask, ref_mask=ref_mask,
                                     q_segment_ids=qs, kv_segment_ids=ks)
    assert np.all(out[0, -5:].astype(np.float32) == 0)
    assert np.all(lse[0, :, -5:] == -np.inf)
    assert np.all(dq[0, -5:].astype(np.float32) == 0)
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(np.asarray(x, np.float32)).any()


def test_segments_sinks_softcap_gqa_offsets_together():
    rng = np.random.default_rng(42)
    Sq, Skv = 48, 80
    q, k, v, dout = _make(rng, Sq=Sq, Skv=Skv, H=6, Hkv=2, D=24, Dv=40)
    qs, ks = _segments(2, Sq, Skv)
    _run(q, k, v, dout, mask=CausalMask((Sq, Skv), offset=Skv - Sq) & LocalMask((Sq, Skv), (30, 0),
                                                                               offset=Skv - Sq),
         sinks=np.linspace(-1, 1, 6).astype(np.float32), logits_soft_cap=3.0,
         q_segment_ids=qs, kv_segment_ids=ks, scale=0.3)


def test_fully_masked_problem_is_zero_and_finite():
    rng = np.random.default_rng(43)
    q, k, v, dout = _make(rng, Sq=32, Skv=32)
    out, lse, (dq, dk, dv, _) = _run(q, k, v, dout, mask=NumpyMask(np.zeros((32, 32), bool)))
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


# ----------------------------------------------------------------------------- memory layout

@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_non_contiguous_inputs(dtype):
    rng = np.random.default_rng(51)
    B, Sq, H, D = 2, 40, 4, 16
    # [B, H, S, D] memory viewed as [B, S, H, D].
    qm = rng.standard_normal((B, H, Sq, D)).astype(dtype)
    km = rng.standard_normal((B, 2, Sq, D)).astype(dtype)
    vm = rng.standard_normal((B, 2, Sq, 2 * D)).astype(dtype)[..., ::2]  # strided last dim too
    dm = rng.standard_normal((B, H, Sq, D)).astype(dtype)
    q, k, v, dout = (x.transpose(0, 2, 1, 3) for x in (qm, km, vm, dm))
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    out, lse, grads = _run(q, k, v, dout, mask=CausalMask((Sq, Sq)))
    # Same numbers as contiguous copies.
    out_c = rs.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), mask=CausalMask((Sq, Sq)))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_c, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_negative_strides(dtype):
    rng = np.random.default_rng(53)
    Sq = 40
    q, k, v, dout = _make(rng, Sq=Sq, Skv=Sq, H=4, Hkv=2, D=16, Dv=16, dtype=dtype)
    # Reversed sequence with a matching reversed dense mask.
    rev = (slice(None), slice(None, None, -1))
    dense = np.tril(np.ones((Sq, Sq), bool))[::-1, ::-1]
    _run(q[rev], k[rev], v[rev], dout[rev], mask=NumpyMask(np.ascontiguousarray(dense)))


def test_inputs_are_not_modified():
    rng = np.random.default_rng(52)
    q, k, v, dout = _make(rng, Sq=32, Skv=32)
    copies = [x.copy() for x in (q, k, v, dout)]
    out, lse = rs.attention(q, k, v, mask="causal", return_lse=True)
    out_copy, lse_copy = out.copy(), lse.copy()
    rs.attention_backward(q, k, v, out, lse, dout, mask="causal")
    for a, b in zip((q, k, v, dout, out, lse), copies + [out_copy, lse_copy]):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- tuning knobs

@pytest.mark.parametrize("api_kw", [
    dict(block_sizes=(16, 16)),
    dict(block_sizes=(32, 64)),
    dict(block_sizes=rs.BlockSizes(q=64, kv=32)),
    dict(block_sizes=rs.BlockSizes(q=128, kv=128)),
    dict(block_sizes=(16, 48), num_threads=1),
    dict(num_threads=1),
    dict(num_threads=2),
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_block_sizes_and_threads_do_not_change_results(api_kw):
    rng = np.random.default_rng(61)
    Sq, Skv = 96, 128
    q, k, v, dout = _make(rng, Sq=Sq, Skv=Skv, H=4, Hkv=2, D=32, Dv=32)
    qs, ks = _segments(2, Sq, Skv)
    m = CausalMask((Sq, Skv), offset=32) & LocalMask((Sq, Skv), (40, None), offset=32)
    kw = dict(mask=m, sinks=np.array([0., 1., -1., 2.], np.float32), q_segment_ids=qs,
              kv_segment_ids=ks)
    out, lse, grads = _run(q, k, v, dout, api_kw=api_kw, **kw)
    out0, lse0 = rs.attention(q, k, v, return_lse=True, **kw)
    vmax = np.abs(v).max()
    _assert_close("out vs default blocks", out, out0.astype(np.float64), atol=2 * F32_OUT * vmax)
    _assert_close("lse vs default blocks", lse, lse0.astype(np.float64), atol=1e-4)


def test_default_return_is_out_only():
    rng = np.random.default_rng(71)
    q, k, v, _ = _make(rng, Sq=16, Skv=16, H=2, Hkv=2, D=8, Dv=8)
    out = rs.attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == (2, 16, 2, 8)
    ro, _ = R.attention_reference(_f64(q), _f64(k), _f64(v))
    _assert_close("out", out, ro, atol=F32_OUT * np.abs(v).max())

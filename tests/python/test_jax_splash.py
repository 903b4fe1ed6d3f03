"""ringsplash.jax.make_splash_attention against the f64 reference.

Forward (out and, through ``kernel.with_lse``, lse) and gradients
(dq, dk, dv, dsinks by ``jax.grad`` of ``sum(out * w)``, so the reference's
dout is ``w``) under ``jit``, ``grad`` and ``vmap``, with f32 and bf16 inputs,
every kind of mask, segments (including a query document with no keys),
sinks, soft cap and GQA / MQA; plus agreement with
``jax.nn.dot_product_attention`` where that function has the feature
(causal, local window, GQA; f32).

Tolerances are those of test_numpy_api.py (see its docstring for the error
model): f32 out 1e-5 * max|v|, lse 1e-5 * max(1, max|lse|), gradients
2e-5 * max|reference gradient|; bf16 out (2^-8 + 1e-5) * max|v| plus half a
bf16 ulp (2^-9 relative) of the stored result, gradients 2^-6 * max|reference
gradient| plus that storage rounding. Here the backward uses the kernel's own
bf16 out (the custom_vjp residual), which adds the forward's error to
D = dout . out; measured on the avx512_bf16 path it stays below 0.3 of the
gradient bound. Weights w for bf16 runs are bf16-representable, so the
cotangent the kernel receives (w converted to bf16) is exactly the
reference's dout.
"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from ringsplash import SegmentIds  # noqa: E402
from ringsplash import reference as R  # noqa: E402
from ringsplash.jax import make_splash_attention  # noqa: E402
from ringsplash.masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask,  # noqa: E402
                              MultiHeadMask, NumpyMask)
from checks import assert_close as _assert_close  # noqa: E402
from checks import f64 as _f64  # noqa: E402

BF16 = ml_dtypes.bfloat16
F32_OUT = 1e-5
F32_GRAD = 2e-5





def _make(rng, B=2, Sq=64, Skv=64, H=4, Hkv=2, D=32, Dv=32, dtype=np.float32, lead=()):
    def r(*shape, s=1.0):
        return (s * rng.standard_normal(lead + shape)).astype(dtype)
    return r(B, Sq, H, D, s=1.5), r(B, Skv, Hkv, D), r(B, Skv, Hkv, Dv), r(B, Sq, H, Dv)


def _tolerances(dtype):
    low = np.dtype(dtype) != np.float32
    return dict(u_p=2.0**-8 if low else 0.0, u_out=2.0**-9 if low else 0.0,
                grad=2.0**-6 if low else F32_GRAD)


def _check_against_reference(q, k, v, w, out, lse, grads, *, sinks=None, ref_mask=None, **rkw):
    """out / lse / (dq, dk, dv, dsinks) of the kernel vs the reference on the same inputs."""
    t = _tolerances(q.dtype)
    ro, rl = R.attention_reference(_f64(q), _f64(k), _f64(v), mask=ref_mask, sinks=_f64(sinks),
                                   **rkw)
    vmax = np.abs(_f64(v)).max()
    _assert_close("out", out, ro, atol=(t["u_p"] + F32_OUT) * vmax * (1 + t["u_out"]),
                  rtol=t["u_out"])
    if lse is not None:
        _assert_close("lse", lse, rl,
                      atol=F32_OUT * max(1.0, np.abs(rl[np.isfinite(rl)]).max(initial=0)))
    if grads is None:
        return
    rg = R.attention_backward_reference(_f64(q), _f64(k), _f64(v), _f64(w), mask=ref_mask,
                                        sinks=_f64(sinks), **rkw)
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], rg[:3]):
        _assert_close(name, got, want, atol=t["grad"] * np.abs(want).max(), rtol=t["u_out"])
    if sinks is not None:
        D = np.einsum("bqhd,bqhd->bhq", _f64(w), ro)
        s64 = _f64(sinks)[None, :, None]
        fin = np.isfinite(rl) & np.isfinite(s64)
        terms = np.where(fin, np.exp(np.where(fin, s64 - np.where(fin, rl, 0), 0)), 0) * np.abs(D)
        low = np.dtype(q.dtype) != np.float32
        _assert_close("dsinks", grads[3], rg[3],
                      atol=(2.0**-7 if low else F32_GRAD) * terms.sum() + 1e-7)


def _run_kernel(kernel, q, k, v, w, segment_ids=None, sinks=None):
    """jit(with_lse) forward and jit(grad) of sum(out * w) -> (out, lse, grads)."""
    fwd = jax.jit(lambda q, k, v, seg, s: kernel.with_lse(q, k, v, segment_ids=seg, sinks=s))
    out, lse = fwd(q, k, v, segment_ids, sinks)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    # Plain kernel (not with_lse) gives the same out.
    out2 = jax.jit(lambda q, k, v, seg, s: kernel(q, k, v, segment_ids=seg, sinks=s))(
        q, k, v, segment_ids, sinks)
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))
    wj = jnp.asarray(np.asarray(w, np.float32))

    def loss(q, k, v, s):
        o = kernel(q, k, v, segment_ids=segment_ids, sinks=s)
        return jnp.sum(o.astype(jnp.float32) * wj)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, sinks)
    for g, x in zip(grads, (q, k, v, sinks)):
        assert g.shape == np.shape(x) and g.dtype == jnp.asarray(x).dtype
    if sinks is None:
        grads = tuple(grads) + (None,)
    return out, lse, grads


S = 64


def _cases():
    sh = (S, S)
    rng = np.random.default_rng(5)
    dense = rng.random(sh) < 0.35
    dense[3] = False
    return {
        "full": FullMask(sh),
        "causal": CausalMask(sh),
        "causal_offset": CausalMask(sh, offset=-4),
        "local": LocalMask(sh, window_size=(7, 2)),
        "local_one_sided": LocalMask(sh, window_size=(None, 3), offset=-5),
        "chunked": ChunkedCausalMask(sh, 16),
        "numpy": NumpyMask(dense),
        "and": CausalMask(sh) & LocalMask(sh, (10, None)),
        "or": ChunkedCausalMask(sh, 8) | LocalMask(sh, (3, 3)),
        "multihead": MultiHeadMask([CausalMask(sh), FullMask(sh), LocalMask(sh, (2, 2)),
                                    NumpyMask(dense)]),
    }


MASKS = _cases()


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_f32(name):
    rng = np.random.default_rng(len(name))
    q, k, v, w = _make(rng)
    kernel = make_splash_attention(MASKS[name])
    out, lse, grads = _run_kernel(kernel, q, k, v, w)
    _check_against_reference(q, k, v, w, out, lse, grads, ref_mask=MASKS[name])


@pytest.mark.parametrize("name", ["causal", "local", "numpy", "multihead"])
def test_masks_bf16(name):
    rng = np.random.default_rng(3 + len(name))
    q, k, v, w = _make(rng, dtype=BF16)
    kernel = make_splash_attention(MASKS[name])
    out, lse, grads = _run_kernel(kernel, q, k, v, w)
    _check_against_reference(q, k, v, w, out, lse, grads, ref_mask=MASKS[name])


def test_mask_text():
    rng = np.random.default_rng(8)
    q, k, v, w = _make(rng)
    kernel = make_splash_attention("causal & local:6,0")
    out, lse, grads = _run_kernel(kernel, q, k, v, w)
    _check_against_reference(q, k, v, w, out, lse, grads,
                             ref_mask=CausalMask((S, S)) & LocalMask((S, S), (6, 0)))


def _segments(B, Sq, Skv):
    """Packed documents; query document 7 (batch 0, last 6 rows) has no keys."""
    qs = np.repeat(np.array([[0] * (Sq // 2) + [1] * (Sq - Sq // 2)]), B, axis=0).astype(np.int32)
    ks = np.repeat(np.array([[0] * (Skv // 3) + [1] * (Skv - Skv // 3)]), B, axis=0)
    ks = ks.astype(np.int32)
    qs[0, -6:] = 7
    return qs, ks


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_segments_sinks_softcap_gqa(dtype, H, Hkv):
    rng = np.random.default_rng(H + 10 * Hkv)
    Sq, Skv = 48, 80
    q, k, v, w = _make(rng, Sq=Sq, Skv=Skv, H=H, Hkv=Hkv, D=32, Dv=16, dtype=dtype)
    m = CausalMask((Sq, Skv), offset=Skv - Sq)
    qs, ks = _segments(2, Sq, Skv)
    sinks = np.linspace(-1.0, 1.5, H).astype(np.float32)
    kernel = make_splash_attention(m, logits_soft_cap=2.5, scale=0.3)
    out, lse, grads = _run_kernel(kernel, q, k, v, w, segment_ids=SegmentIds(qs, ks),
                                  sinks=jnp.asarray(sinks))
    _check_against_reference(q, k, v, w, out, lse, grads, ref_mask=m, sinks=sinks,
                             logits_soft_cap=2.5, scale=0.3, q_segment_ids=qs,
                             kv_segment_ids=ks)
    # The query document without keys: out 0, lse = sink, zero dq, no NaN anywhere.
    assert np.all(np.asarray(out, np.float32)[0, -6:] == 0)
    np.testing.assert_array_equal(np.asarray(lse)[0, :, -6:],
                                  np.broadcast_to(sinks[:, None], (H, 6)))
    assert np.all(np.asarray(grads[0], np.float32)[0, -6:] == 0)


def test_empty_query_document_without_sinks_gives_minus_inf_lse_and_no_nan():
    rng = np.random.default_rng(9)
    q, k, v, w = _make(rng)
    qs, ks = _segments(2, S, S)
    kernel = make_splash_attention(None)
    out, lse, grads = _run_kernel(kernel, q, k, v, w, segment_ids=SegmentIds(qs, ks))
    _check_against_reference(q, k, v, w, out, lse, grads, q_segment_ids=qs, kv_segment_ids=ks)
    assert np.all(np.asarray(lse)[0, :, -6:] == -np.inf)
    assert np.all(np.asarray(out)[0, -6:] == 0)
    for g in grads[:3]:
        assert np.isfinite(np.asarray(g)).all()


def test_block_sizes_do_not_change_results():
    rng = np.random.default_rng(10)
    q, k, v, w = _make(rng, Sq=96, Skv=96)
    m = LocalMask((96, 96), (20, 0))
    for bs in [(16, 16), (32, 64), (128, 128)]:
        kernel = make_splash_attention(m, block_sizes=bs, num_threads=1)
        out, lse, grads = _run_kernel(kernel, q, k, v, w)
        _check_against_reference(q, k, v, w, out, lse, grads, ref_mask=m)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_vmap_forward_and_grad(dtype):
    rng = np.random.default_rng(11)
    N, Sq = 3, 32
    q, k, v, w = _make(rng, B=2, Sq=Sq, Skv=Sq, H=4, Hkv=2, D=16, Dv=16, dtype=dtype, lead=(N,))
    m = CausalMask((Sq, Sq)) | LocalMask((Sq, Sq), (0, 2))
    qs = np.stack([np.sort(rng.integers(0, 2 + i, (2, Sq)), axis=1) for i in range(N)])
    qs = qs.astype(np.int32)
    seg = SegmentIds(qs, qs)
    sinks = np.array([0.1, -0.3, 0.7, -2.0], np.float32)
    kernel = make_splash_attention(m)
    outs = jax.jit(jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s,
                                                       sinks=jnp.asarray(sinks))))(q, k, v, seg)
    wj = jnp.asarray(np.asarray(w, np.float32))

    def loss(q, k, v, s, w_, seg):
        o = kernel(q, k, v, segment_ids=seg, sinks=s)
        return jnp.sum(o.astype(jnp.float32) * w_)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)),
                             in_axes=(0, 0, 0, None, 0, 0)))(q, k, v, jnp.asarray(sinks), wj, seg)
    assert outs.shape == (N,) + q.shape[1:4] + (16,)
    assert grads[3].shape == (N, 4)  # per-example dsinks
    for i in range(N):
        _check_against_reference(q[i], k[i], v[i], w[i], outs[i], None,
                                 tuple(g[i] for g in grads), ref_mask=m, sinks=sinks,
                                 q_segment_ids=qs[i], kv_segment_ids=qs[i])


def test_retracing_for_new_shapes_reuses_the_kernel():
    kernel = make_splash_attention(CausalMask((40, 40)))
    f = jax.jit(kernel)
    rng = np.random.default_rng(12)
    for B, H, Hkv in [(1, 2, 1), (2, 4, 4)]:
        q, k, v, w = _make(rng, B=B, Sq=40, Skv=40, H=H, Hkv=Hkv, D=8, Dv=8)
        _check_against_reference(q, k, v, w, f(q, k, v), None, None, ref_mask=CausalMask((40, 40)))


# ----------------------------------------------------------------------------- jax.nn agreement

@pytest.mark.parametrize("feature", ["causal", "window", "causal_window", "gqa_causal", "mqa"])
def test_agrees_with_jax_nn_dot_product_attention(feature):
    rng = np.random.default_rng(13)
    H, Hkv = {"gqa_causal": (8, 2), "mqa": (4, 1)}.get(feature, (4, 4))
    q, k, v, w = _make(rng, Sq=S, Skv=S, H=H, Hkv=Hkv, D=32, Dv=32)
    sh = (S, S)
    mask, kw = {
        "causal": (CausalMask(sh), dict(is_causal=True)),
        "window": (LocalMask(sh, (5, 3)), dict(local_window_size=(5, 3))),
        "causal_window": (CausalMask(sh) & LocalMask(sh, (9, 0)),
                          dict(is_causal=True, local_window_size=(9, 0))),
        "gqa_causal": (CausalMask(sh), dict(is_causal=True)),
        "mqa": (FullMask(sh), dict()),
    }[feature]
    kernel = make_splash_attention(mask)
    wj = jnp.asarray(w)

    def ours(q, k, v):
        return jnp.sum(kernel(q, k, v) * wj)

    def theirs(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, **kw) * wj)

    o1 = jax.jit(kernel)(q, k, v)
    o2 = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw))(q, k, v)
    g1 = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(theirs, argnums=(0, 1, 2)))(q, k, v)
    # Both are f32 computations of the same quantity: twice the single-sided bound.
    _assert_close("out", o1, np.asarray(o2, np.float64), atol=2 * F32_OUT * np.abs(v).max())
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        b = np.asarray(b, np.float64)
        _assert_close(name, a, b, atol=2 * F32_GRAD * np.abs(b).max())
    # And the reference agrees with both (guards against a shared misreading).
    _check_against_reference(q, k, v, w, o1, None, tuple(g1) + (None,), ref_mask=mask)


@pytest.mark.parametrize("check_vma", [True, False])
def test_batch_sharded_in_shard_map_with_grad(check_vma):
    # Data parallelism: the batch split over 2 devices, each calling the
    # single-device kernel on its examples inside shard_map. Gradients of the
    # replicated sinks must be summed over the devices (once), those of q, k, v
    # stay per example; everything equals the reference on the whole batch.
    from jax.sharding import Mesh, PartitionSpec as P

    rng = np.random.default_rng(77)
    q, k, v, w = _make(rng, B=2, Sq=S, Skv=S, H=4, Hkv=2)
    sinks = rng.standard_normal(4).astype(np.float32)
    mask = CausalMask((S, S))
    kernel = make_splash_attention(mask)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    wj = jnp.asarray(w)
    spec = P("data")
    sharded = jax.shard_map(lambda q, k, v, s: kernel.with_lse(q, k, v, sinks=s), mesh=mesh,
                            in_specs=(spec, spec, spec, P()), out_specs=(spec, spec),
                            check_vma=check_vma)

    def loss(q, k, v, s):
        return jnp.sum(sharded(q, k, v, s)[0] * wj)

    out, lse = jax.jit(sharded)(q, k, v, sinks)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    _check_against_reference(q, k, v, w, out, lse, grads, sinks=sinks, ref_mask=mask)

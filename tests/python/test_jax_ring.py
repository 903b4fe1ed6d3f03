"""ringsplash.jax.make_ring_attention in jax.shard_map rings, and the layouts.

Every ring result is compared with the float64 reference
(``ringsplash.reference``, written from SPEC §2-3 independently of the C++
kernels and of ring.py) over the WHOLE, unsharded sequence: out, lse and the
gradients dq, dk, dv, dsinks of ``sum(out * w)`` taken by ``jax.grad`` through
``shard_map`` (so the reference's dout is ``w``). Rings of 1, 2, 4 and 8 host
devices (conftest.py asks XLA for 8): every layout x {causal, sliding window,
chunked causal, NumpyMask (with fully masked rows), segments crossing shards
(with a query document that has no keys), sinks, soft cap, GQA / MQA with
Dv != D} at N = 2 and 4, a representative subset at N = 1 and 8. Block sizes
are 16 x 16 on local slices of 8-32 rows, so whole blocks and whole ring steps
are empty and skipped, and masks are evaluated across shard boundaries.

Tolerances follow test_numpy_api.py's error model (see its docstring): f32 out
2e-5 * max|v|, lse 2e-5 * max(1, max|lse|), dq/dk/dv 1e-4 * max|reference
gradient|, dsinks 1e-4 * sum|exp(sink - lse) D|. The ring adds only the f32
log-sum-exp merge of N <= 8 partial results (out_a + sigmoid(d) (out_b - out_a)
and lse_a + softplus(d): a few f32 roundings, ~N * 2^-24 relative, far below
these bounds) and the f32 sums of N partial dq / dk / dv (same order). A wrong
position, a dropped mask term across shards or a slice's gradient sent to the
wrong rank moves results by O(1e-2) or more; a dsinks summed N times is off by
a factor N.

Compile time dominates (one jit of forward + backward per case, about 0.5 s):
shapes are tiny (B = 1, S = 64 or 128, H <= 4, D = 16).
"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import ringsplash  # noqa: E402
from ringsplash import SegmentIds, layouts  # noqa: E402
from ringsplash import reference as R  # noqa: E402
from ringsplash.jax import (make_ring_attention, make_splash_attention,  # noqa: E402
                            shard_sequence, unshard_sequence)
from ringsplash.jax.ring import _positions  # noqa: E402
from ringsplash.masks import (CausalMask, ChunkedCausalMask, LocalMask,  # noqa: E402
                              MultiHeadMask, NumpyMask)
from checks import assert_close as _assert_close  # noqa: E402
from checks import f64 as _f64  # noqa: E402

if hasattr(jax, "shard_map"):
    _shard_map = jax.shard_map
else:  # older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    def _shard_map_compat(f, *, mesh, in_specs, out_specs, check_vma=True):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_rep=check_vma)

    _shard_map = _shard_map_compat

LAYOUTS = ("contiguous", "zigzag", "striped")
BLOCKS = (16, 16)
F32_OUT = 2e-5
F32_GRAD = 1e-4
BF16 = ml_dtypes.bfloat16
AXIS = "ring"


def _need_devices(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} host devices (XLA_FLAGS=--xla_force_host_platform_device_count)")


_MESHES = {}


def _mesh(n):
    _need_devices(n)
    if n not in _MESHES:
        _MESHES[n] = Mesh(np.array(jax.devices()[:n]), (AXIS,))
    return _MESHES[n]


# --------------------------------------------------------------------------
# Checking against the reference.




def _check(case, out, lse, grads, low_precision=False):
    """out / lse / (dq, dk, dv, dsinks) vs the f64 reference on the same inputs."""
    q, k, v, w = (_f64(case[x]) for x in ("q", "k", "v", "w"))
    rkw = dict(mask=case.get("ref_mask", case["mask"]), scale=case.get("scale"), logits_soft_cap=case.get("cap"),
               sinks=_f64(case.get("sinks")), q_segment_ids=case.get("q_seg"),
               kv_segment_ids=case.get("kv_seg"))
    ro, rl = R.attention_reference(q, k, v, **rkw)
    # bf16: P rounded to bf16 in the kernels (2^-8 relative) and the result stored
    # as bf16 (2^-9 relative), as in test_numpy_api.py.
    u_p, u_out, grad_tol = (2.0**-8, 2.0**-9, 2.0**-6) if low_precision else (0, 0, F32_GRAD)
    vmax = np.abs(v).max()
    _assert_close("out", out, ro, atol=(u_p + F32_OUT) * vmax * (1 + u_out), rtol=u_out)
    _assert_close("lse", lse, rl, atol=F32_OUT * max(1.0, np.abs(rl[np.isfinite(rl)]).max()))
    rg = R.attention_backward_reference(q, k, v, w, **rkw)
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], rg[:3]):
        _assert_close(name, got, want, atol=grad_tol * np.abs(want).max(), rtol=u_out)
    if case.get("sinks") is not None:
        D = np.einsum("bqhd,bqhd->bhq", w, ro)
        s64 = _f64(case["sinks"])[None, :, None]
        fin = np.isfinite(rl) & np.isfinite(s64)
        terms = np.where(fin, np.exp(np.where(fin, s64 - np.where(fin, rl, 0), 0)), 0) * np.abs(D)
        _assert_close("dsinks", grads[3], rg[3],
                      atol=(2.0**-7 if low_precision else F32_GRAD) * terms.sum() + 1e-7)
    return ro, rl, rg


# --------------------------------------------------------------------------
# Running a ring.

def _ring_loss(kernel, n, layout, w, *, has_seg, has_sinks, check_vma=True):
    """loss(q, k, v, sinks, q_seg, kv_seg) -> (sum(out * w), (out, lse)) on global arrays,
    through shard_sequence -> shard_map(kernel.with_lse) -> unshard_sequence."""
    mesh = _mesh(n)
    seq = P(None, AXIS)

    def body(q, k, v, *rest):
        rest = list(rest)
        seg = SegmentIds(rest.pop(0), rest.pop(0)) if has_seg else None
        sinks = rest.pop(0) if has_sinks else None
        return kernel.with_lse(q, k, v, segment_ids=seg, sinks=sinks)

    in_specs = (seq, seq, seq) + ((seq, seq) if has_seg else ()) + ((P(),) if has_sinks else ())
    ring = _shard_map(body, mesh=mesh, in_specs=in_specs,
                      out_specs=(seq, P(None, None, AXIS)), check_vma=check_vma)
    wj = jnp.asarray(np.asarray(w, np.float32))

    def loss(q, k, v, sinks, q_seg, kv_seg):
        def sh(x):
            return shard_sequence(x, n, layout)
        args = [sh(q), sh(k), sh(v)]
        if has_seg:
            args += [sh(q_seg), sh(kv_seg)]
        if has_sinks:
            args.append(sinks)
        out, lse = ring(*args)
        out = unshard_sequence(out, n, layout)
        lse = unshard_sequence(lse, n, layout, axis=2)
        return jnp.sum(out.astype(jnp.float32) * wj), (out, lse)

    return loss


def _run(case, n, layout, check_vma=True):
    """jit(value_and_grad) of the ring on the case -> (out, lse, (dq, dk, dv, dsinks))."""
    kernel = make_ring_attention(case["mask"], ring_axis=AXIS, layout=layout,
                                 scale=case.get("scale"), logits_soft_cap=case.get("cap"),
                                 block_sizes=BLOCKS)
    sinks = case.get("sinks")
    has_seg = case.get("q_seg") is not None
    loss = _ring_loss(kernel, n, layout, case["w"], has_seg=has_seg,
                      has_sinks=sinks is not None, check_vma=check_vma)
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    f = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
    (_, (out, lse)), grads = f(case["q"], case["k"], case["v"], sinks, case.get("q_seg"),
                               case.get("kv_seg"))
    assert out.dtype == case["q"].dtype and lse.dtype == jnp.float32
    for g, x in zip(grads, (case["q"], case["k"], case["v"], sinks)):
        assert g.shape == np.shape(x) and g.dtype == np.asarray(x).dtype
    if sinks is None:
        grads = tuple(grads) + (None,)
    return out, lse, grads


# --------------------------------------------------------------------------
# Cases: global arrays and masks.

def _arrays(rng, S, H=2, Hkv=2, D=16, Dv=16, Skv=None, q_scale=1.5, dtype=np.float32):
    Skv = S if Skv is None else Skv

    def r(*shape, s=1.0):
        return (s * rng.standard_normal(shape)).astype(dtype)
    return dict(q=r(1, S, H, D, s=q_scale), k=r(1, Skv, Hkv, D), v=r(1, Skv, Hkv, Dv),
                w=r(1, S, H, Dv))


def _segments(S):
    """Documents whose boundaries cut across every shard of every layout, and a
    query-only document (id 9, no keys): its rows are fully masked."""
    seg = np.zeros((1, S), np.int32)
    for i, b in enumerate((0, 11, 29, 30, 47, S * 5 // 6)):
        seg[:, b:] = i
    q_seg = seg.copy()
    q_seg[:, S // 2 - 3:S // 2 + 2] = 9
    return q_seg, seg


def _case(name, S, seed=0):
    rng = np.random.default_rng(seed)
    sh = (S, S)
    if name == "causal":
        return dict(_arrays(rng, S), mask=CausalMask(sh))
    if name == "local":  # sliding window crossing shard boundaries
        return dict(_arrays(rng, S), mask=LocalMask(sh, window_size=(9, 2)))
    if name == "chunked":  # chunks of 24: not aligned with any shard
        return dict(_arrays(rng, S), mask=ChunkedCausalMask(sh, 24))
    if name == "numpy":  # dense, with fully masked rows (out 0, lse -inf, no NaN)
        dense = rng.random(sh) < 0.3
        dense[[3, S // 2, S - 1]] = False
        return dict(_arrays(rng, S), mask=NumpyMask(dense))
    if name == "segments":
        q_seg, kv_seg = _segments(S)
        return dict(_arrays(rng, S), mask=CausalMask(sh), q_seg=q_seg, kv_seg=kv_seg)
    if name == "sinks":  # one head's sink is -inf (= no sink); window rows are never empty
        sinks = np.array([0.7, -np.inf], np.float32)
        return dict(_arrays(rng, S), mask=LocalMask(sh, window_size=(5, 0)), sinks=sinks)
    if name == "softcap":  # large logits so that the cap matters
        return dict(_arrays(rng, S, q_scale=4.0), mask=CausalMask(sh), cap=3.0, scale=0.5)
    if name == "gqa":  # MQA (one kv head for four query heads), Dv != D
        return dict(_arrays(rng, S, H=4, Hkv=1, Dv=24), mask=CausalMask(sh))
    raise ValueError(name)


CASES = ("causal", "local", "chunked", "numpy", "segments", "sinks", "softcap", "gqa")


def _seq_len(n):
    return 64 if n <= 4 else 128  # zigzag at N = 8: 16 chunks of 8 rows


# Every layout x case at N = 2 and 4; a representative subset at N = 1 and 8.
PARAMS = (
    [pytest.param(n, layout, name, id=f"n{n}-{layout}-{name}")
     for n in (2, 4) for layout in LAYOUTS for name in CASES]
    + [pytest.param(1, "zigzag", name, id=f"n1-zigzag-{name}")
       for name in ("causal", "numpy", "segments", "sinks")]
    + [pytest.param(8, layout, name, id=f"n8-{layout}-{name}")
       for layout, name in (("zigzag", "causal"), ("zigzag", "segments"), ("zigzag", "sinks"),
                            ("striped", "local"), ("striped", "gqa"),
                            ("contiguous", "chunked"), ("contiguous", "softcap"),
                            ("zigzag", "numpy"))]
)


@pytest.mark.parametrize("n,layout,name", PARAMS)
def test_ring_matches_reference(n, layout, name):
    case = _case(name, _seq_len(n))
    out, lse, grads = _run(case, n, layout)
    _check(case, out, lse, grads)


# --------------------------------------------------------------------------
# Single device, other arguments, other transforms.

def test_ring_equals_single_device_kernel():
    """N = 4 ring vs make_splash_attention on the unsharded arrays (same kernels:
    the difference is the merge order only), forward-only path included."""
    n, layout, S = 4, "zigzag", 64
    case = _case("segments", S, seed=3)
    case["sinks"] = np.array([0.3, -1.0], np.float32)
    mask = case["mask"]
    seg = SegmentIds(case["q_seg"], case["kv_seg"])
    single = make_splash_attention(mask, block_sizes=BLOCKS)
    so, sl = jax.jit(lambda q, k, v, s: single.with_lse(q, k, v, segment_ids=seg, sinks=s))(
        case["q"], case["k"], case["v"], case["sinks"])
    out, lse, grads = _run(case, n, layout)
    vmax = np.abs(case["v"]).max()
    _assert_close("out", out, _f64(so), atol=F32_OUT * vmax)
    _assert_close("lse", lse, _f64(sl), atol=F32_OUT * max(1.0, np.abs(np.asarray(sl)[
        np.isfinite(np.asarray(sl))]).max()))
    _check(case, out, lse, grads)

    # The primal path (no differentiation): plain kernel(...) in shard_map.
    kernel = make_ring_attention(mask, ring_axis=AXIS, layout=layout, block_sizes=BLOCKS)
    seq = P(None, AXIS)
    ring = jax.jit(_shard_map(lambda q, k, v, qs, ks, s: kernel(q, k, v, SegmentIds(qs, ks), s),
                              mesh=_mesh(n), in_specs=(seq,) * 5 + (P(),), out_specs=seq))
    sh = [shard_sequence(case[x], n, layout) for x in ("q", "k", "v", "q_seg", "kv_seg")]
    plain = unshard_sequence(ring(*sh, case["sinks"]), n, layout)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(out))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_cross_lengths_with_offset(layout):
    """Sq != Skv: 32 queries at the end of 64 keys (CausalMask with offset), N = 2."""
    rng = np.random.default_rng(7)
    case = dict(_arrays(rng, 32, Skv=64), mask=CausalMask((32, 64), offset=32))
    out, lse, grads = _run(case, 2, layout)
    _check(case, out, lse, grads)


def test_ring_multihead_mask_and_combinations():
    """MultiHeadMask and & / | on global positions, N = 4, striped."""
    S = 64
    sh = (S, S)
    rng = np.random.default_rng(11)
    mh = MultiHeadMask([CausalMask(sh) & LocalMask(sh, (12, None)),
                        ChunkedCausalMask(sh, 8) | LocalMask(sh, (3, 3))])
    case = dict(_arrays(rng, S), mask=mh)
    out, lse, grads = _run(case, 4, "striped")
    _check(case, out, lse, grads)


def test_ring_mask_text_and_none():
    """Masks given as the command line's text (no shape) and None (full), N = 2."""
    S = 64
    rng = np.random.default_rng(29)
    case = dict(_arrays(rng, S), mask="causal & local:9,0",
                ref_mask=CausalMask((S, S)) & LocalMask((S, S), (9, 0)))
    out, lse, grads = _run(case, 2, "zigzag")
    _check(case, out, lse, grads)
    case = dict(_arrays(rng, S), mask=None)
    out, lse, grads = _run(case, 2, "striped")
    _check(case, out, lse, grads)


def test_ring_bf16():
    rng = np.random.default_rng(13)
    case = dict(_arrays(rng, 64, dtype=BF16), mask=LocalMask((64, 64), (20, 0)),
                sinks=np.array([0.5, -0.5], np.float32))
    out, lse, grads = _run(case, 2, "zigzag")
    assert out.dtype == BF16
    _check(case, out, lse, grads, low_precision=True)


def test_ring_check_vma_false():
    """shard_map(check_vma=False): dsinks is then the local share (JAX's transpose
    sums replicated inputs' cotangents itself); the result must still be exact,
    not N times too large."""
    case = _case("sinks", 64)
    case["mask"] = CausalMask((64, 64))
    out, lse, grads = _run(case, 4, "zigzag", check_vma=False)
    _check(case, out, lse, grads)


def test_ring_grad_inside_shard_map():
    """The usual training step: jax.grad inside shard_map. Gradients are those of
    the global loss (the sum of every device's loss): dq/dk/dv per shard and a
    ring-invariant dsinks equal to the global one."""
    n, layout, S = 2, "zigzag", 64
    case = _case("sinks", S, seed=17)
    kernel = make_ring_attention(case["mask"], ring_axis=AXIS, layout=layout, block_sizes=BLOCKS)
    seq = P(None, AXIS)

    def body(q, k, v, s, w):
        def local_loss(q, k, v, s):
            return jnp.sum(kernel(q, k, v, sinks=s) * w)
        return jax.grad(local_loss, argnums=(0, 1, 2, 3))(q, k, v, s)

    f = jax.jit(_shard_map(body, mesh=_mesh(n), in_specs=(seq, seq, seq, P(), seq),
                           out_specs=(seq, seq, seq, P())))
    sh = [shard_sequence(case[x], n, layout) for x in ("q", "k", "v")]
    dq, dk, dv, ds = f(*sh, case["sinks"], shard_sequence(case["w"], n, layout))
    grads = [unshard_sequence(g, n, layout) for g in (dq, dk, dv)] + [ds]
    rg = R.attention_backward_reference(*(_f64(case[x]) for x in ("q", "k", "v", "w")),
                                        mask=case["mask"], sinks=_f64(case["sinks"]))
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, rg):
        _assert_close(name, got, want, atol=F32_GRAD * max(1.0, np.abs(want).max()))


def _dense_attention_jnp(q, k, v, allowed, sinks, scale):
    """Plain f32 attention in jnp (for gradients through lse): [B,S,H,D], no GQA."""
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where(allowed[None, None], s, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
    lse = jax.nn.logsumexp(jnp.concatenate([s, sink], axis=-1), axis=-1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


def test_ring_gradient_through_lse():
    """with_lse: a loss that uses lse as well as out (cotangent of lse != 0)."""
    n, layout, S = 4, "zigzag", 64
    rng = np.random.default_rng(19)
    case = dict(_arrays(rng, S), mask=CausalMask((S, S)),
                sinks=np.array([0.2, 1.1], np.float32))
    wl = rng.standard_normal((1, 2, S)).astype(np.float32)
    kernel = make_ring_attention(case["mask"], ring_axis=AXIS, layout=layout, block_sizes=BLOCKS)
    inner = _ring_loss(kernel, n, layout, case["w"], has_seg=False, has_sinks=True)

    def loss(q, k, v, s):
        val, (_, lse) = inner(q, k, v, s, None, None)
        return val + jnp.sum(lse * wl)

    def dense_loss(q, k, v, s):
        allowed = jnp.tril(jnp.ones((S, S), bool))
        out, lse = _dense_attention_jnp(q, k, v, allowed, s, 1 / np.sqrt(16))
        return jnp.sum(out * case["w"]) + jnp.sum(lse * wl)

    args = (case["q"], case["k"], case["v"], case["sinks"])
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2, 3)))(*args)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        w = _f64(w)
        # Both sides f32: twice the f32 gradient bound.
        _assert_close(name, g, w, atol=2 * F32_GRAD * max(1.0, np.abs(w).max()))


# --------------------------------------------------------------------------
# Layouts.

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_layout_positions_partition_the_sequence(layout, n):
    S = 2 * n * 5
    pos = [layouts.positions(layout, S, r, n) for r in range(n)]
    for p in pos:
        assert p.dtype == np.int64 and p.size == S // n and np.all(np.diff(p) > 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(pos)), np.arange(S))
    np.testing.assert_array_equal(layouts.permutation(layout, S, n), np.concatenate(pos))
    # The ring's traced-rank formula gives the same positions.
    for r in range(n):
        np.testing.assert_array_equal(np.asarray(_positions(layout, S // n, jnp.int32(r), n)),
                                      pos[r])
    x = np.random.default_rng(n).standard_normal((2, S, 3)).astype(np.float32)
    xs = layouts.shard(x, layout, n)
    for r in range(n):
        np.testing.assert_array_equal(xs[:, r * S // n:(r + 1) * S // n], x[:, pos[r]])
    np.testing.assert_array_equal(layouts.unshard(xs, layout, n), x)
    np.testing.assert_array_equal(np.asarray(shard_sequence(jnp.asarray(x), n, layout)), xs)
    np.testing.assert_array_equal(
        np.asarray(unshard_sequence(jnp.asarray(xs), n, layout)), x)
    # Other axes (lse is [B, H, S]; unbatched segment ids are [S]).
    np.testing.assert_array_equal(
        np.asarray(shard_sequence(jnp.asarray(x[0, :, 0]), n, layout, axis=0)), xs[0, :, 0])
    np.testing.assert_array_equal(layouts.shard(np.moveaxis(x, 1, 2), layout, n, axis=2),
                                  np.moveaxis(xs, 1, 2))


def test_layout_examples():
    np.testing.assert_array_equal(layouts.positions("contiguous", 16, 1, 4), [4, 5, 6, 7])
    np.testing.assert_array_equal(layouts.positions("zigzag", 16, 1, 4), [2, 3, 12, 13])
    np.testing.assert_array_equal(layouts.positions("striped", 16, 1, 4), [1, 5, 9, 13])


def test_layout_errors():
    with pytest.raises(ringsplash.InvalidArgumentError, match=r"12.*2 \* 4 ranks = 8"):
        layouts.check_divisible("zigzag", 12, 4, "query sequence")
    with pytest.raises(ValueError, match=r"10.*number of ranks, 4"):
        layouts.positions("contiguous", 10, 0, 4)
    with pytest.raises(ringsplash.InvalidArgumentError, match="unknown sequence layout"):
        layouts.permutation("diagonal", 8, 2)
    with pytest.raises(ringsplash.InvalidArgumentError, match="rank"):
        layouts.positions("striped", 8, 2, 2)
    with pytest.raises(ringsplash.InvalidArgumentError, match=r"length 10 .* divisible"):
        shard_sequence(jnp.zeros((1, 10, 2, 4)), 4, "striped")
    with pytest.raises(ringsplash.InvalidArgumentError, match="unknown sequence layout"):
        make_ring_attention(CausalMask((8, 8)), ring_axis=AXIS, layout="diagonal")


# --------------------------------------------------------------------------
# Bad input: clear errors at trace time (nothing runs, nothing can hang).

def _ring_call(kernel, n, S, H=2, Hkv=2, D=16, mesh_axis=AXIS):
    _need_devices(n)
    mesh = Mesh(np.array(jax.devices()[:n]), (mesh_axis,))
    seq = P(None, mesh_axis)
    f = jax.jit(_shard_map(lambda q, k, v: kernel(q, k, v), mesh=mesh, in_specs=(seq,) * 3,
                           out_specs=seq))
    x = jnp.zeros((1, S, H, D), jnp.float32)
    kv = jnp.zeros((1, S, Hkv, D), jnp.float32)
    return f(x, kv, kv)


def test_error_ring_axis_missing():
    kernel = make_ring_attention(CausalMask((32, 32)), ring_axis="sp", block_sizes=BLOCKS)
    with pytest.raises(ringsplash.InvalidArgumentError, match=r"ring axis 'sp' does not exist"):
        _ring_call(kernel, 2, 32, mesh_axis="data")
    # Outside shard_map altogether.
    with pytest.raises(ValueError, match="shard_map"):
        kernel(jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)))


def test_error_indivisible_sequence():
    # zigzag over 4 ranks needs S % 8 == 0: 4 local rows of 12 global... 12 % 8 != 0.
    kernel = make_ring_attention(CausalMask((12, 12)), ring_axis=AXIS, layout="zigzag")
    with pytest.raises(ringsplash.InvalidArgumentError, match=r"12 must be divisible by 2 \* 4"):
        _ring_call(kernel, 4, 12)


def test_error_mask_shape():
    kernel = make_ring_attention(CausalMask((32, 32)), ring_axis=AXIS, block_sizes=BLOCKS)
    with pytest.raises(ringsplash.InvalidArgumentError,
                       match=r"mask shape \(32, 32\) does not match .* \(64, 64\)"):
        _ring_call(kernel, 2, 64)
    sh = (32, 32)
    kernel = make_ring_attention(MultiHeadMask([CausalMask(sh)] * 3), ring_axis=AXIS)
    with pytest.raises(ringsplash.InvalidArgumentError, match="3 heads"):
        _ring_call(kernel, 2, 32)


def test_error_bad_arguments():
    kernel = make_ring_attention(CausalMask((32, 32)), ring_axis=AXIS, block_sizes=BLOCKS)
    seq = P(None, AXIS)
    mesh = _mesh(2)
    x = jnp.zeros((1, 32, 2, 16), jnp.float32)

    def call(fn, *args, specs):
        return jax.jit(_shard_map(fn, mesh=mesh, in_specs=specs, out_specs=seq))(*args)

    with pytest.raises(ringsplash.InvalidArgumentError, match="4 dims"):
        call(lambda q: kernel(q[0], q[0], q[0]), x, specs=(seq,))
    with pytest.raises(ringsplash.DTypeError, match="one dtype"):
        call(lambda q: kernel(q, q.astype(jnp.bfloat16), q), x, specs=(seq,))
    with pytest.raises(ringsplash.InvalidArgumentError, match="H_kv dividing"):
        call(lambda q: kernel(q, q[:, :, :1].repeat(3, 2), q[:, :, :1].repeat(3, 2)), x,
             specs=(seq,))
    with pytest.raises(ringsplash.InvalidArgumentError, match="sinks"):
        call(lambda q, s: kernel(q, q, q, sinks=s), x, jnp.zeros(3), specs=(seq, P()))
    with pytest.raises(ringsplash.InvalidArgumentError, match="segment ids"):
        call(lambda q, s: kernel(q, q, q, segment_ids=SegmentIds(s, s)), x,
             jnp.zeros((1, 64), jnp.int32), specs=(seq, P()))
    with pytest.raises(ringsplash.InvalidArgumentError, match="logits_soft_cap"):
        make_ring_attention(None, ring_axis=AXIS, logits_soft_cap=-1.0)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_on_2d_mesh(check_vma):
    """Data parallel x ring: batch sharded over 'data', sequence over the ring,
    sinks replicated. dsinks sums over both (the batch and the sequence)."""
    _need_devices(4)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", AXIS))
    n, layout, S = 2, "striped", 64
    rng = np.random.default_rng(23)
    case = dict(q=rng.standard_normal((2, S, 2, 16)).astype(np.float32),
                k=rng.standard_normal((2, S, 2, 16)).astype(np.float32),
                v=rng.standard_normal((2, S, 2, 16)).astype(np.float32),
                w=rng.standard_normal((2, S, 2, 16)).astype(np.float32),
                mask=LocalMask((S, S), (13, 4)), sinks=np.array([0.4, -0.2], np.float32))
    kernel = make_ring_attention(case["mask"], ring_axis=AXIS, layout=layout, block_sizes=BLOCKS)
    spec = P("data", AXIS)
    ring = _shard_map(lambda q, k, v, s: kernel.with_lse(q, k, v, sinks=s), mesh=mesh,
                      in_specs=(spec, spec, spec, P()), out_specs=(spec, P("data", None, AXIS)),
                      check_vma=check_vma)

    def loss(q, k, v, s):
        out, lse = ring(*(shard_sequence(x, n, layout) for x in (q, k, v)), s)
        out = unshard_sequence(out, n, layout)
        return jnp.sum(out * case["w"]), (out, unshard_sequence(lse, n, layout, axis=2))

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                        has_aux=True))(
        case["q"], case["k"], case["v"], case["sinks"])
    _check(case, out, lse, grads)

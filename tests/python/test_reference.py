"""Sanity tests of the float64 NumPy reference itself (no C++ involved).

The reference (python/ringsplash/reference.py) is what every other Python
test trusts, so it is checked here against things that do not share its
code: a per-element loop written from SPEC §2, probabilities that must sum to
one, and central finite differences of its forward for its backward.

The module is loaded from its file, not through ``import ringsplash``, so
these tests run without the compiled extension.
"""

import importlib.util
import math
import pathlib

import numpy as np
import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "python" / "ringsplash" / "reference.py"
_spec = importlib.util.spec_from_file_location("ringsplash_reference_standalone", _PATH)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


# Stand-ins with the class names and fields of ringsplash.masks, so the
# reference's mask evaluator is tested without the package.
class CausalMask:
    def __init__(self, shape, offset=0):
        self.shape, self.offset = shape, offset


class LocalMask:
    def __init__(self, shape, window_size, offset=0):
        self.shape, self.window_size, self.offset = shape, window_size, offset


class ChunkedCausalMask:
    def __init__(self, shape, chunk_size):
        self.shape, self.chunk_size = shape, chunk_size


class FullMask:
    def __init__(self, shape):
        self.shape = shape


class NumpyMask:
    def __init__(self, array):
        self.array = np.asarray(array, dtype=bool)
        self.shape = self.array.shape


class MultiHeadMask:
    def __init__(self, masks):
        self.masks = tuple(masks)


class LogicalAnd:
    def __init__(self, left, right):
        self.left, self.right = left, right


class LogicalOr:
    def __init__(self, left, right):
        self.left, self.right = left, right


def _allowed_scalar(m, i, j):
    """Per-element mask predicate written straight from the SPEC §3 table."""
    n = type(m).__name__
    if n == "FullMask":
        return True
    if n == "CausalMask":
        return i + m.offset >= j
    if n == "LocalMask":
        left, right = m.window_size
        ok = True
        if left is not None:
            ok = ok and i + m.offset - left <= j
        if right is not None:
            ok = ok and j <= i + m.offset + right
        return ok
    if n == "ChunkedCausalMask":
        return i // m.chunk_size == j // m.chunk_size and i >= j
    if n == "NumpyMask":
        return bool(m.array[i, j])
    if n == "LogicalAnd":
        return _allowed_scalar(m.left, i, j) and _allowed_scalar(m.right, i, j)
    if n == "LogicalOr":
        return _allowed_scalar(m.left, i, j) or _allowed_scalar(m.right, i, j)
    raise TypeError(n)


def _naive_forward(q, k, v, allowed, scale, cap, sinks):
    """Element-by-element loop of SPEC §2; allowed is [B, H, Sq, Skv]."""
    B, Sq, H, _ = q.shape
    Skv, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((B, Sq, H, Dv))
    lse = np.zeros((B, H, Sq))
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Sq):
                logits = []
                for j in range(Skv):
                    if not allowed[b, h, i, j]:
                        continue
                    s = scale * sum(q[b, i, h, d] * k[b, j, g, d] for d in range(q.shape[3]))
                    if cap is not None:
                        s = cap * math.tanh(s / cap)
                    logits.append((j, s))
                terms = [math.exp(s) for _, s in logits]
                if sinks is not None and sinks[h] != -math.inf:
                    terms.append(math.exp(sinks[h]))
                total = sum(terms)
                if total == 0:
                    lse[b, h, i] = -math.inf
                    continue
                lse[b, h, i] = math.log(total)
                for j, s in logits:
                    out[b, i, h] += math.exp(s) / total * v[b, j, g]
    return out, lse


def _inputs(rng, B=2, Sq=5, Skv=7, H=4, Hkv=2, D=3, Dv=2):
    q = rng.standard_normal((B, Sq, H, D))
    k = rng.standard_normal((B, Skv, Hkv, D))
    v = rng.standard_normal((B, Skv, Hkv, Dv))
    return q, k, v


def test_dense_mask_of_every_mask_object_matches_the_spec_table():
    S, T = 9, 11
    masks = [
        FullMask((S, T)),
        CausalMask((S, T)),
        CausalMask((S, T), offset=2),
        CausalMask((S, T), offset=-3),
        LocalMask((S, T), (2, 1)),
        LocalMask((S, T), (None, 0), offset=1),
        LocalMask((S, T), (0, None)),
        LocalMask((S, T), (1, 3), offset=-2),
        ChunkedCausalMask((S, T), 4),
        NumpyMask(np.random.default_rng(0).random((S, T)) < 0.5),
        LogicalAnd(CausalMask((S, T)), LocalMask((S, T), (3, 0))),
        LogicalOr(ChunkedCausalMask((S, T), 3), LocalMask((S, T), (1, 1))),
        LogicalAnd(LogicalOr(CausalMask((S, T)), LocalMask((S, T), (0, 2))),
                   ChunkedCausalMask((S, T), 5)),
    ]
    for m in masks:
        want = np.array([[_allowed_scalar(m, i, j) for j in range(T)] for i in range(S)])
        got = ref.dense_mask(m, np.arange(S), np.arange(T))
        assert got.shape == (1, S, T)
        np.testing.assert_array_equal(got[0], want, err_msg=type(m).__name__)
        # Global positions: a window of rows / columns is the slice of the global matrix.
        qp, kp = np.arange(3, 8), np.arange(4, 11)
        np.testing.assert_array_equal(ref.dense_mask(m, qp, kp)[0], want[3:8][:, 4:11])
    mh = MultiHeadMask([CausalMask((S, T)), FullMask((S, T)), LocalMask((S, T), (1, 1))])
    got = ref.dense_mask(mh, np.arange(S), np.arange(T))
    assert got.shape == (3, S, T)
    np.testing.assert_array_equal(got[0], np.tril(np.ones((S, T), bool)))
    assert got[1].all()
    # A 2-D mask combined with a per-head mask broadcasts over heads.
    both = ref.dense_mask(LogicalAnd(mh, CausalMask((S, T))), np.arange(S), np.arange(T))
    np.testing.assert_array_equal(both, got & np.tril(np.ones((S, T), bool)))


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_forward_matches_per_element_loop(cap, use_sinks):
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng)
    B, Sq, H, _ = q.shape
    Skv = k.shape[1]
    dense = rng.random((H, Sq, Skv)) < 0.6
    dense[1, 2, :] = False  # a fully masked row
    qseg = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]])
    kseg = np.array([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])  # q doc 2 of b0 has no keys
    sinks = np.array([0.3, -np.inf, -1.0, 2.0]) if use_sinks else None
    allowed = dense[None] & (qseg[:, None, :, None] == kseg[:, None, None, :])
    want_out, want_lse = _naive_forward(q, k, v, allowed, 0.7, cap, sinks)
    out, lse = ref.attention_reference(q, k, v, mask=dense, scale=0.7, logits_soft_cap=cap,
                                       sinks=sinks, q_segment_ids=qseg, kv_segment_ids=kseg)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    # Spot-check SPEC §2.6 explicitly: no keys -> out 0, lse -inf (or the sink).
    assert np.all(out[:, 2, 1] == 0)
    if use_sinks:
        assert lse[0, 1, 2] == -np.inf and lse[0, 0, 4] == 0.3  # head 1's sink is -inf
    else:
        assert lse[0, 1, 2] == -np.inf and lse[0, 0, 4] == -np.inf


def test_default_scale_is_one_over_sqrt_d():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, D=5)
    a = ref.attention_reference(q, k, v)
    b = ref.attention_reference(q, k, v, scale=1 / math.sqrt(5))
    np.testing.assert_array_equal(a[0], b[0])
    c = ref.attention_reference(q, k, v, scale=1.0)
    assert np.abs(a[0] - c[0]).max() > 1e-3


def test_probabilities_sum_to_one():
    rng = np.random.default_rng(3)
    q, k, _ = _inputs(rng)
    ones = np.ones(k.shape[:3] + (1,))
    m = CausalMask((5, 7), offset=-1)  # row 0 has no key
    out, lse = ref.attention_reference(q, k, ones, mask=m)
    np.testing.assert_allclose(out[:, 1:], 1.0, rtol=1e-14)
    assert np.all(out[:, 0] == 0) and np.all(lse[:, :, 0] == -np.inf)
    # With sinks the keys' share is 1 - exp(sink - lse).
    sinks = np.array([0.5, -2.0, 1.0, 0.0])
    out, lse = ref.attention_reference(q, k, ones, mask=m, sinks=sinks)
    share = 1 - np.exp(sinks[None, :, None] - lse)  # [B, H, Sq]
    np.testing.assert_allclose(out[..., 0], share.transpose(0, 2, 1), rtol=1e-12, atol=1e-15)
    assert np.all(lse[:, :, 0] == sinks[None, :])


def test_minus_inf_sink_is_no_sink_and_huge_cap_is_no_cap():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng)
    base = ref.attention_reference(q, k, v, mask=CausalMask((5, 7)))
    no = ref.attention_reference(q, k, v, mask=CausalMask((5, 7)), sinks=np.full(4, -np.inf))
    np.testing.assert_array_equal(base[0], no[0])
    np.testing.assert_array_equal(base[1], no[1])
    capped = ref.attention_reference(q, k, v, mask=CausalMask((5, 7)), logits_soft_cap=1e6)
    np.testing.assert_allclose(capped[0], base[0], rtol=1e-9, atol=1e-12)
    strong = ref.attention_reference(q, k, v, mask=CausalMask((5, 7)), logits_soft_cap=0.5)
    assert np.abs(strong[0] - base[0]).max() > 1e-3


def test_gqa_equals_replicated_heads():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, H=6, Hkv=2)
    dout = rng.standard_normal(q.shape[:3] + (v.shape[3],))
    m = LocalMask((5, 7), (2, 1))
    rep = np.repeat(np.arange(2), 3)  # h // (H // Hkv)
    out, lse = ref.attention_reference(q, k, v, mask=m)
    out_r, lse_r = ref.attention_reference(q, k[:, :, rep], v[:, :, rep], mask=m)
    np.testing.assert_allclose(out, out_r, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, lse_r, rtol=1e-13)
    dq, dk, dv, _ = ref.attention_backward_reference(q, k, v, dout, mask=m)
    dq_r, dk_r, dv_r, _ = ref.attention_backward_reference(q, k[:, :, rep], v[:, :, rep], dout,
                                                           mask=m)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dk_r.reshape(dk.shape[:2] + (2, 3, -1)).sum(3), atol=1e-13)
    np.testing.assert_allclose(dv, dv_r.reshape(dv.shape[:2] + (2, 3, -1)).sum(3), atol=1e-13)


def test_positions_select_rows_of_the_global_problem():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, Sq=12, Skv=12)
    m = LogicalOr(ChunkedCausalMask((12, 12), 4), LocalMask((12, 12), (1, 0)))
    out, lse = ref.attention_reference(q, k, v, mask=m)
    rows = np.array([9, 2, 7])
    o2, l2 = ref.attention_reference(q[:, rows], k, v, mask=m, q_positions=rows)
    np.testing.assert_allclose(o2, out[:, rows], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(l2, lse[:, :, rows], rtol=1e-13)


def _loss(q, k, v, sinks, dout, kw):
    out, _ = ref.attention_reference(q, k, v, sinks=sinks, **kw)
    return float(np.sum(out * dout))


@pytest.mark.parametrize("cap", [None, 0.8])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_backward_matches_finite_differences(cap, use_sinks):
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, B=1, Sq=4, Skv=5, H=4, Hkv=2, D=3, Dv=2)
    q *= 2.0  # larger logits make the soft cap matter
    dout = rng.standard_normal(q.shape[:3] + (2,))
    sinks = np.array([0.2, -0.5, 1.0, -np.inf]) if use_sinks else None
    kw = dict(mask=LogicalAnd(CausalMask((4, 5), offset=1), LocalMask((4, 5), (2, None))),
              logits_soft_cap=cap, q_segment_ids=np.array([[0, 0, 1, 2]]),
              kv_segment_ids=np.array([[0, 0, 1, 1, 1]]))  # query doc 2 has no keys
    dq, dk, dv, dsinks = ref.attention_backward_reference(q, k, v, dout, sinks=sinks, **kw)
    assert (dsinks is None) == (not use_sinks)
    eps = 1e-6

    def fd(x, which):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            if not np.isfinite(x[idx]):
                continue
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = {"q": q, "k": k, "v": v, "sinks": sinks}
            lo = dict(args, **{which: minus})
            hi = dict(args, **{which: plus})
            g[idx] = (_loss(hi["q"], hi["k"], hi["v"], hi["sinks"], dout, kw) -
                      _loss(lo["q"], lo["k"], lo["v"], lo["sinks"], dout, kw)) / (2 * eps)
        return g

    for name, got, x in [("dq", dq, q), ("dk", dk, k), ("dv", dv, v)]:
        np.testing.assert_allclose(got, fd(x, name[1]), rtol=1e-6, atol=1e-8, err_msg=name)
    if use_sinks:
        np.testing.assert_allclose(dsinks, fd(sinks, "sinks"), rtol=1e-6, atol=1e-8)
        assert dsinks[3] == 0.0
    # The empty query row (doc 2, position 3) gets zero gradient.
    assert np.all(dq[0, 3] == 0)


def test_fully_masked_everything_is_finite_without_floating_point_warnings():
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng)
    dout = rng.standard_normal(q.shape[:3] + (v.shape[3],))
    none = np.zeros((5, 7), dtype=bool)
    with np.errstate(all="raise"):
        out, lse = ref.attention_reference(q, k, v, mask=none, logits_soft_cap=2.0)
        dq, dk, dv, ds = ref.attention_backward_reference(q, k, v, dout, mask=none,
                                                          sinks=np.array([0., 1., -np.inf, 3.]))
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0) and np.all(ds == 0)


def test_mask_shape_must_have_one_or_h_heads():
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng)
    with pytest.raises(AssertionError):
        ref.attention_reference(q, k, v, mask=np.ones((3, 5, 7), bool))
    with pytest.raises(ValueError):
        ref.attention_reference(q, k, v, q_segment_ids=np.zeros((2, 5), np.int32))

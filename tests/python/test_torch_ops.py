"""ringsplash.torch (attention, scaled_dot_product_attention) against the f64 reference and F.sdpa.

Forward (out and, with ``return_lse=True``, lse) and gradients (dq, dk, dv and
dsinks through autograd, of ``sum(out * w)`` so that the reference's dout is
``w``; plus ``sum(lse * wl)`` where lse is used) for f32 and bf16 tensors, both
layouts ("bshd" / "bhsd"), non-contiguous views, every kind of mask (objects,
text), windows, soft cap, sinks, segments and GQA / MQA; agreement with
``torch.nn.functional.scaled_dot_product_attention`` where that function has
the feature (causal, boolean masks of every broadcast shape, GQA through
``enable_gqa``, scale); ``torch.compile(fullgraph=True)``; no copies of
contiguous inputs; bad inputs.

How gradients are checked: the op accepts float32 / bfloat16 / float16 only,
not float64, so ``torch.autograd.gradcheck`` cannot be used; every gradient is
compared instead with ``ringsplash.reference.attention_backward_reference``
(float64 NumPy, written from SPEC §2 independently of the C++ code) run on the
same input values, and the gradient through lse with a float64 eager PyTorch
computation whose forward is itself checked against that reference.

Tolerances are those of test_numpy_api.py (see its docstring for the error
model); the reference always runs on the values the kernel was given (bf16
inputs converted exactly to float64), so input rounding never counts:

* f32: out 1e-5 * max|v|, lse 1e-5 * max(1, max|lse|), gradients
  2e-5 * max|reference gradient|, dsinks 2e-5 * sum_{b,i} |exp(sink - lse_i) D_i|.
* bf16: out (2^-8 + 1e-5) * max|v| (P rounded to bf16 before the P.V tile
  product) plus half a bf16 ulp (2^-9 relative) of the stored result; lse the
  f32 bound; gradients 2^-6 * max|reference gradient| plus the storage
  rounding; dsinks 2^-7 * sum |exp(sink - lse) D|. As in test_jax_splash.py
  the backward gets the kernel's own bf16 out (the autograd residual), so the
  forward's error enters D = dout . out; measured it stays below half of the
  gradient bound (f32: below 0.05 of it). The weights w are made in the
  inputs' dtype, so the gradient the op receives (w converted to that dtype)
  is exactly the reference's dout.
* f16 (one test): as bf16 with half an f16 ulp (2^-12 relative) for the storage.
* Against F.sdpa (another kernel with the same error model: on CPU its flash
  kernel also accumulates in f32 and rounds P to bf16 for bf16 inputs) the
  difference of the two results is bounded by the sum of both bounds: twice
  the ones above.
"""

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import ringsplash as rs  # noqa: E402
import ringsplash.torch as rt  # noqa: E402
from ringsplash import reference as R  # noqa: E402
from ringsplash.masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask,  # noqa: E402
                              MultiHeadMask, NumpyMask)
from checks import assert_close as _assert_close  # noqa: E402

F32_OUT = 1e-5
F32_GRAD = 2e-5
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


STORAGE_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}


def _tolerances(dtype):
    low = dtype != torch.float32
    return dict(u_p=2.0**-8 if low else 0.0, u_out=STORAGE_ROUNDING[dtype],
                grad=2.0**-6 if low else F32_GRAD, sinks=2.0**-7 if low else F32_GRAD)


def _np64(t, layout="bshd"):
    """A tensor's exact float64 values as NumPy, in [B, S, H, D] order."""
    if t is None:
        return None
    a = t.detach().to(torch.float64)
    if layout == "bhsd" and a.dim() == 4:
        a = a.transpose(1, 2)
    return a.numpy()




def _make(seed, B=2, Sq=64, Skv=64, H=4, Hkv=2, D=32, Dv=32, dtype=torch.float32,
          layout="bshd"):
    """Leaf q, k, v (requires_grad) and weights w (out's shape) in `layout` and `dtype`."""
    g = torch.Generator().manual_seed(seed)

    def r(b, s, h, d, scale=1.0):
        shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return (scale * torch.randn(shape, generator=g)).to(dtype)
    q = r(B, Sq, H, D, 1.5).requires_grad_()  # logits O(1..10): far from a uniform softmax
    k = r(B, Skv, Hkv, D).requires_grad_()
    v = r(B, Skv, Hkv, Dv).requires_grad_()
    w = r(B, Sq, H, Dv)
    return q, k, v, w


def _sinks(H, requires_grad=True):
    return torch.linspace(-1.0, 2.0, H).requires_grad_(requires_grad)


def _reference(q, k, v, w, *, mask=None, sinks=None, **rkw):
    """f64 (out, lse, (dq, dk, dv, dsinks)); a 4-D boolean array mask is per batch element."""
    if isinstance(mask, np.ndarray) and mask.ndim == 4:
        parts = [_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], w[b:b + 1], mask=mask[b],
                            sinks=sinks, **rkw) for b in range(q.shape[0])]
        ro = np.concatenate([p[0] for p in parts])
        rl = np.concatenate([p[1] for p in parts])
        grads = [np.concatenate([p[2][i] for p in parts]) for i in range(3)]
        ds = None if sinks is None else sum(p[2][3] for p in parts)
        return ro, rl, tuple(grads) + (ds,)
    ro, rl = R.attention_reference(q, k, v, mask=mask, sinks=sinks, **rkw)
    grads = R.attention_backward_reference(q, k, v, w, mask=mask, sinks=sinks, **rkw)
    return ro, rl, grads


def _run(fn, q, k, v, w, sinks=None):
    """out, lse (or None) of fn(q, k, v) and the gradients of sum(out * w) (dsinks too)."""
    res = fn(q, k, v)
    out, lse = res if isinstance(res, tuple) else (res, None)
    inputs = [x for x in (q, k, v, sinks) if x is not None and x.requires_grad]
    loss = (out.float() * w.float()).sum()
    grads = torch.autograd.grad(loss, inputs) if inputs else ()
    return out, lse, grads


def _check(q, k, v, w, out, lse, grads, *, layout="bshd", ref_mask=None, sinks=None, **rkw):
    """out / lse / (dq, dk, dv, dsinks) against the reference on the same inputs."""
    t = _tolerances(q.dtype)
    assert out.dtype == q.dtype
    q64, k64, v64, w64 = (_np64(x, layout) for x in (q, k, v, w))
    s64 = _np64(sinks)
    ro, rl, rg = _reference(q64, k64, v64, w64, mask=ref_mask, sinks=s64, **rkw)
    vmax = np.abs(v64).max()
    _assert_close("out", _np64(out, layout), ro,
                  atol=(t["u_p"] + F32_OUT) * vmax * (1 + t["u_out"]), rtol=t["u_out"])
    if lse is not None:
        assert lse.dtype == torch.float32 and tuple(lse.shape) == rl.shape
        _assert_close("lse", _np64(lse), rl,
                      atol=F32_OUT * max(1.0, np.abs(rl[np.isfinite(rl)]).max(initial=0)))
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, rg[:3], (q, k, v)):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        _assert_close(name, _np64(got, layout), want, atol=t["grad"] * np.abs(want).max(),
                      rtol=t["u_out"])
    if sinks is not None and sinks.requires_grad:
        assert len(grads) == 4
        D = np.einsum("bqhd,bqhd->bhq", w64, ro)
        fin = np.isfinite(rl)
        terms = np.where(fin, np.exp(s64[None, :, None] - np.where(fin, rl, 0.0)), 0.0)
        _assert_close("dsinks", _np64(grads[3]), rg[3],
                      atol=t["sinks"] * (terms * np.abs(D)).sum() + 1e-7)
    return ro, rl, rg


# ----------------------------------------------------------------------------- attention()

S = 64


def _mask_cases():
    sh = (S, S)
    g = np.random.default_rng(123)
    dense = g.random(sh) < 0.3
    dense[5] = False  # a row with no key
    causal = CausalMask(sh)
    return {
        "none": (None, None),
        "full": (FullMask(sh), None),
        "causal": (causal, causal),
        "causal_offset": (CausalMask(sh, offset=-7), CausalMask(sh, offset=-7)),  # empty rows
        "local": (LocalMask(sh, (6, 3)), LocalMask(sh, (6, 3))),
        "chunked": (ChunkedCausalMask(sh, 16), ChunkedCausalMask(sh, 16)),
        "numpy": (NumpyMask(dense), NumpyMask(dense)),
        "and_or": ((causal | LocalMask(sh, (0, 3))) & ChunkedCausalMask(sh, 32),
                   (causal | LocalMask(sh, (0, 3))) & ChunkedCausalMask(sh, 32)),
        "multihead": (MultiHeadMask([causal, LocalMask(sh, (4, 4)), ChunkedCausalMask(sh, 8),
                                     NumpyMask(dense)]),) * 2,
        "text": ("causal & local:8,0", CausalMask(sh) & LocalMask(sh, (8, 0))),
        "text_chunked_or": ("chunked:8 | local:3,0",
                            ChunkedCausalMask(sh, 8) | LocalMask(sh, (3, 0))),
    }


MASKS = _mask_cases()


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_f32(name):
    mask, ref_mask = MASKS[name]
    q, k, v, w = _make(zlib.crc32(name.encode()))
    out, lse, grads = _run(lambda q, k, v: rt.attention(q, k, v, mask=mask, return_lse=True),
                           q, k, v, w)
    _check(q, k, v, w, out, lse, grads, ref_mask=ref_mask)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", list(DTYPES) + ["f16"])
def test_layouts_dtypes_sinks_soft_cap(layout, dtype):
    """Both layouts and dtypes, with sinks (requires_grad) and a soft cap."""
    dt = DTYPES.get(dtype, torch.float16)
    q, k, v, w = _make(7, dtype=dt, layout=layout)
    sinks = _sinks(4)
    m = CausalMask((S, S), offset=-3) & LocalMask((S, S), (20, 0), offset=-3)  # rows 0-2: sink only
    out, lse, grads = _run(
        lambda q, k, v: rt.attention(q, k, v, mask=m, sinks=sinks, logits_soft_cap=4.0,
                                     layout=layout, return_lse=True), q, k, v, w, sinks)
    assert out.shape == q.shape and out.dtype == dt
    assert tuple(lse.shape) == (2, 4, S)
    _check(q, k, v, w, out, lse, grads, layout=layout, ref_mask=m, sinks=sinks,
           logits_soft_cap=4.0)
    rows = out[:, :3] if layout == "bshd" else out[:, :, :3]
    assert torch.all(rows == 0)
    torch.testing.assert_close(lse[:, :, :3], sinks.detach()[None, :, None].expand(2, 4, 3),
                               rtol=0, atol=0)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gqa_mqa(H, Hkv, dtype):
    q, k, v, w = _make(H * 10 + Hkv, Sq=48, Skv=48, H=H, Hkv=Hkv, D=16, Dv=16,
                       dtype=DTYPES[dtype], layout="bhsd")
    m = LocalMask((48, 48), (12, 0))
    out, lse, grads = _run(lambda q, k, v: rt.attention(q, k, v, mask=m, layout="bhsd"),
                           q, k, v, w)
    _check(q, k, v, w, out, None, grads, layout="bhsd", ref_mask=m)


@pytest.mark.parametrize("Sq,Skv,D,Dv", [(32, 96, 32, 16), (96, 32, 16, 48), (1, 80, 32, 32)])
def test_sq_skv_d_dv_differ(Sq, Skv, D, Dv):
    q, k, v, w = _make(Sq + Skv, Sq=Sq, Skv=Skv, H=4, Hkv=1, D=D, Dv=Dv)
    m = CausalMask((Sq, Skv), offset=Skv - Sq)  # bottom-right aligned; Sq > Skv: empty rows
    out, lse, grads = _run(lambda q, k, v: rt.attention(q, k, v, mask=m, scale=0.2,
                                                        return_lse=True), q, k, v, w)
    assert out.shape == (2, Sq, 4, Dv)
    _check(q, k, v, w, out, lse, grads, ref_mask=m, scale=0.2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_segments_with_an_empty_query_document(dtype):
    q, k, v, w = _make(41, dtype=DTYPES[dtype])
    qs = torch.zeros(2, S, dtype=torch.int64)  # int64 ids are accepted (converted)
    ks = torch.zeros(2, S, dtype=torch.int32)
    qs[:, S // 3:] = 1
    ks[:, S // 4:] = 1
    qs[:, 2 * S // 3:] = 2
    ks[:, S // 2:] = 2
    qs[0, -5:] = 9  # no key is in document 9
    out, lse, grads = _run(lambda q, k, v: rt.attention(
        q, k, v, mask="causal", q_segment_ids=qs, kv_segment_ids=ks, return_lse=True), q, k, v, w)
    _check(q, k, v, w, out, lse, grads, ref_mask=CausalMask((S, S)), q_segment_ids=qs.numpy(),
           kv_segment_ids=ks.numpy())
    assert torch.all(out[0, -5:] == 0) and torch.all(lse[0, :, -5:] == -torch.inf)
    assert torch.all(grads[0][0, -5:] == 0)


def _torch_f64_attention(q, k, v, allowed, *, scale, cap=None, sinks=None):
    """Plain float64 PyTorch attention (differentiable), [B, S, H, D]; for lse gradients."""
    H, Hkv = q.shape[2], k.shape[2]
    kh = k.repeat_interleave(H // Hkv, dim=2)
    vh = v.repeat_interleave(H // Hkv, dim=2)
    s = scale * torch.einsum("bqhd,bkhd->bhqk", q, kh)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~allowed, -torch.inf)
    full = s
    if sinks is not None:
        full = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, vh), lse


@pytest.mark.parametrize("with_out", [True, False], ids=["out_and_lse", "lse_only"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradient_through_lse(dtype, with_out):
    """d/d(q, k, v, sinks) of sum(out * w) + sum(lse * wl), against float64 PyTorch autograd."""
    dt = DTYPES[dtype]
    t = _tolerances(dt)
    q, k, v, w = _make(61, dtype=dt)
    sinks = _sinks(4)
    wl = torch.randn(2, 4, S, generator=torch.Generator().manual_seed(62))
    m = CausalMask((S, S)) & LocalMask((S, S), (16, 0))

    out, lse = rt.attention(q, k, v, mask=m, sinks=sinks, logits_soft_cap=6.0, return_lse=True)
    loss = (lse * wl).sum() + ((out.float() * w.float()).sum() if with_out else 0.0)
    grads = torch.autograd.grad(loss, (q, k, v, sinks))

    x64 = [torch.from_numpy(_np64(x)).requires_grad_() for x in (q, k, v, sinks)]
    allowed = torch.from_numpy(np.array(R.dense_mask(m, np.arange(S), np.arange(S))))[None]
    o64, l64 = _torch_f64_attention(*x64[:3], allowed, scale=32 ** -0.5, cap=6.0, sinks=x64[3])
    x64n = [x.detach().numpy() for x in x64]
    ro, rl = R.attention_reference(*x64n[:3], mask=m, sinks=x64n[3], logits_soft_cap=6.0)
    np.testing.assert_allclose(o64.detach().numpy(), ro, rtol=0, atol=1e-12)  # the f64 check
    np.testing.assert_allclose(l64.detach().numpy(), rl, rtol=0, atol=1e-12)  # is itself right
    loss64 = (l64 * wl.double()).sum() + ((o64 * w.double()).sum() if with_out else 0.0)
    want = torch.autograd.grad(loss64, x64, allow_unused=True, materialize_grads=True)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        ref = ref.numpy()
        _assert_close(name, _np64(got), ref, atol=t["grad"] * np.abs(ref).max() + 1e-30,
                      rtol=t["u_out"])
    # dsinks = sum_{b,i} exp(sink - lse_i) (wl_i - D_i): bound by the sum of |terms|.
    psink = np.exp(_np64(sinks)[None, :, None] - rl)
    D = np.einsum("bqhd,bqhd->bhq", _np64(w), ro) if with_out else 0.0
    terms = psink * (np.abs(wl.double().numpy()) + np.abs(D))
    _assert_close("dsinks", _np64(grads[3]), want[3].numpy(),
                  atol=t["sinks"] * terms.sum() + 1e-7)
    if not with_out:
        assert torch.all(grads[2] == 0)  # v does not enter lse


@pytest.mark.parametrize("block_sizes,num_threads", [((16, 32), 1), ((64, 16), 2), (None, 0)])
def test_block_sizes_and_threads_change_nothing_but_rounding(block_sizes, num_threads):
    q, k, v, w = _make(131, Sq=80, Skv=80)
    m = CausalMask((80, 80)) & LocalMask((80, 80), (21, 0))
    out, lse, grads = _run(lambda q, k, v: rt.attention(
        q, k, v, mask=m, block_sizes=block_sizes, num_threads=num_threads, return_lse=True),
        q, k, v, w)
    _check(q, k, v, w, out, lse, grads, ref_mask=m)


def test_requires_grad_only_where_asked():
    q, k, v, w = _make(71)
    k.requires_grad_(False)
    sinks = _sinks(4, requires_grad=False)
    out = rt.attention(q, k, v, mask="causal", sinks=sinks)
    assert out.requires_grad
    (out.float() * w).sum().backward()
    assert q.grad is not None and v.grad is not None
    assert k.grad is None and sinks.grad is None
    with torch.no_grad():
        assert not rt.attention(q, k, v, mask="causal").requires_grad
    plain = [x.detach() for x in (q, k, v)]
    out2, lse2 = rt.attention(*plain, mask="causal", sinks=sinks, return_lse=True)
    assert not out2.requires_grad and not lse2.requires_grad
    torch.testing.assert_close(out2, out.detach(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- memory layout

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_non_contiguous_views(dtype):
    """Strided views (slices of a sequence, of heads, of the last dim; transposes) need no copy
    by the caller and give the numbers of contiguous copies, exactly."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(81)
    B, Sq, H, Hkv, D = 2, 40, 4, 2, 16
    qm = torch.randn(B, 2 * Sq, H, D, generator=g).to(dt)[:, ::2]           # every 2nd token
    km = torch.randn(B, Hkv, Sq, D, generator=g).to(dt).transpose(1, 2)      # [B,H,S,D] memory
    vm = torch.randn(B, Sq, 2 * Hkv, 2 * D, generator=g).to(dt)[:, :, 1::2, ::2]  # heads, dim
    w = torch.randn(B, Sq, H, D, generator=g).to(dt)
    q, k, v = (x.requires_grad_() for x in (qm.detach(), km.detach(), vm.detach()))
    for x in (q, k, v):
        assert not x.is_contiguous()
    m = CausalMask((Sq, Sq)) & LocalMask((Sq, Sq), (9, 0))
    out, lse, grads = _run(lambda q, k, v: rt.attention(q, k, v, mask=m, return_lse=True),
                           q, k, v, w)
    _check(q, k, v, w, out, lse, grads, ref_mask=m)
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    out_c, lse_c, grads_c = _run(lambda q, k, v: rt.attention(q, k, v, mask=m, return_lse=True),
                                 qc, kc, vc, w)
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_c, rtol=0, atol=0)
    for a, b in zip(grads, grads_c):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _SpyCore:
    """Stands in for the extension module in _ops: records the tensors the kernels get."""

    def __init__(self, core):
        self._core = core
        self.calls = []

    def forward(self, *args, **kw):
        self.calls.append(("forward", args))
        return self._core.forward(*args, **kw)

    def backward(self, *args, **kw):
        self.calls.append(("backward", args))
        return self._core.backward(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._core, name)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_no_copies_for_contiguous_inputs(layout, monkeypatch):
    """The kernels read q, k, v and dout in the caller's memory (same data_ptr), both layouts."""
    from ringsplash.torch import _ops
    spy = _SpyCore(_ops._core)
    monkeypatch.setattr(_ops, "_core", spy)
    q, k, v, w = _make(91, layout=layout)
    out = rt.attention(q, k, v, mask="causal", layout=layout)
    torch.autograd.grad(out, (q, k, v), grad_outputs=w)
    (f, fargs), (b, bargs) = spy.calls
    assert (f, b) == ("forward", "backward")
    for name, x, got_f, got_b in zip("qkv", (q, k, v), fargs[:3], bargs[:3]):
        assert got_f.data_ptr() == x.data_ptr(), f"{name} copied for the forward ({layout})"
        assert got_b.data_ptr() == x.data_ptr(), f"{name} copied for the backward ({layout})"
    assert bargs[5].data_ptr() == w.data_ptr(), f"dout copied ({layout})"
    assert fargs[3].data_ptr() == out.data_ptr()  # out is the kernel's buffer, not a copy
    # And the SDPA wrapper (bhsd) without attn_mask goes the same way.
    if layout == "bhsd":
        spy.calls.clear()
        rt.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True,
                                        enable_gqa=True)
        (_, fargs), = spy.calls
        assert [a.data_ptr() for a in fargs[:3]] == [x.data_ptr() for x in (q, k, v)]


# ----------------------------------------------------------------------------- SDPA wrapper

def _bhsd_views(seed, B=2, Sq=48, Skv=48, H=4, Hkv=4, D=32, dtype=torch.float32):
    """q, k, v [B, H, S, D] as models make them: projections [B, S, H, D] transposed."""
    q, k, v, w = _make(seed, B=B, Sq=Sq, Skv=Skv, H=H, Hkv=Hkv, D=D, Dv=D, dtype=dtype)
    leaves = (q, k, v)
    return leaves, tuple(x.transpose(1, 2) for x in leaves), w.transpose(1, 2)


def _window_allowed(Sq, Skv, left, right):
    qp, kp = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    ok = torch.ones(Sq, Skv, dtype=torch.bool)
    if left is not None:
        ok &= kp >= qp - left
    if right is not None:
        ok &= kp <= qp + right
    return ok


def _sdpa_cases(B=2, H=4, Sq=48, Skv=48):
    g = torch.Generator().manual_seed(5)

    def rnd(*shape):
        m = torch.rand(*shape, generator=g) < 0.6
        return m | torch.eye(Sq, Skv, dtype=torch.bool)  # no empty row (SDPA differs there)
    return {
        # name: (ringsplash kwargs, F.sdpa kwargs, Hkv)
        "plain": ({}, {}, H),
        "causal": ({"is_causal": True}, {"is_causal": True}, H),
        "scale": ({"scale": 0.3, "is_causal": True}, {"scale": 0.3, "is_causal": True}, H),
        "gqa": ({"enable_gqa": True, "is_causal": True},
                {"enable_gqa": True, "is_causal": True}, 2),
        "mqa_mask": ({"enable_gqa": True, "attn_mask": rnd(Sq, Skv)},
                     {"enable_gqa": True}, 1),
        "mask_2d": ({"attn_mask": rnd(Sq, Skv)}, {}, H),
        "mask_per_head": ({"attn_mask": rnd(H, Sq, Skv)}, {}, H),
        "mask_1hss": ({"attn_mask": rnd(1, H, Sq, Skv)}, {}, H),
        "mask_per_batch": ({"attn_mask": rnd(B, 1, Sq, Skv)}, {}, H),
        "mask_per_batch_and_head": ({"attn_mask": rnd(B, H, Sq, Skv), "scale": 0.25,
                                     "enable_gqa": True},
                                    {"scale": 0.25}, 2),
        "key_padding": ({"attn_mask": torch.tensor([[True] * Skv, [True] * (Skv - 7) + [False] * 7]
                                                   ).view(B, 1, 1, Skv)}, {}, H),
        "query_rows": ({"attn_mask": torch.ones(Sq, 1, dtype=torch.bool)}, {}, H),
        "window_int": ({"window": 8}, {"attn_mask": _window_allowed(Sq, Skv, 8, 0)}, H),
        "window_pair": ({"window": (5, 3)}, {"attn_mask": _window_allowed(Sq, Skv, 5, 3)}, H),
        "window_right_only": ({"window": (None, 4), "enable_gqa": True},
                              {"attn_mask": _window_allowed(Sq, Skv, None, 4),
                               "enable_gqa": True}, 2),
        "window_and_causal": ({"window": (6, 6), "is_causal": True},
                              {"attn_mask": _window_allowed(Sq, Skv, 6, 0)}, H),
        "window_and_mask": ({"window": 10, "attn_mask": rnd(Sq, Skv)},
                            {"attn_mask": _window_allowed(Sq, Skv, 10, 0)}, H),
    }


SDPA_CASES = _sdpa_cases()


def _sdpa_allowed(rs_kw, sdpa_kw):
    """One case's allowed pairs: the boolean mask F.sdpa gets (None: all), broadcastable."""
    mask = sdpa_kw.get("attn_mask", rs_kw.get("attn_mask"))
    if sdpa_kw.get("is_causal"):
        mask = torch.ones(48, 48, dtype=torch.bool).tril()
    if rs_kw.get("attn_mask") is not None and "attn_mask" in sdpa_kw:  # both: intersect
        mask = rs_kw["attn_mask"] & sdpa_kw["attn_mask"]
    return mask


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa_wrapper_matches_torch(name, dtype):
    rs_kw, sdpa_kw, Hkv = SDPA_CASES[name]
    dt = DTYPES[dtype]
    t = _tolerances(dt)
    leaves, (q, k, v), w = _bhsd_views(zlib.crc32(name.encode()), Hkv=Hkv, dtype=dt)
    out, _, grads = _run(lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, **rs_kw),
                         q, k, v, w)
    # The reference: the allowed matrix F.sdpa is given, per batch element.
    allowed = _sdpa_allowed(rs_kw, sdpa_kw)
    ref_mask = None
    if allowed is not None:
        ref_mask = np.broadcast_to(allowed.numpy(), (2, 4) + (48, 48))
    grads_bshd = tuple(g.transpose(1, 2) for g in grads)
    _check(*leaves, w.transpose(1, 2), out.transpose(1, 2), None, grads_bshd, ref_mask=ref_mask,
           scale=rs_kw.get("scale"))
    # F.sdpa on the same views (where it has the feature).
    kw = dict(sdpa_kw)
    if "attn_mask" in rs_kw and "attn_mask" not in kw:
        kw["attn_mask"] = rs_kw["attn_mask"]
    elif "attn_mask" in rs_kw:
        kw["attn_mask"] = allowed
    if "scale" in rs_kw:
        kw["scale"] = rs_kw["scale"]
    if Hkv != 4:
        kw["enable_gqa"] = True
    out_t, _, grads_t = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw),
                             q, k, v, w)
    vmax = v.detach().abs().max().item()
    _assert_close("out vs F.sdpa", _np64(out), _np64(out_t),
                  atol=2 * (t["u_p"] + F32_OUT) * vmax * (1 + t["u_out"]), rtol=2 * t["u_out"])
    for gname, a, b in zip(("dq", "dk", "dv"), grads, grads_t):
        want = _np64(b)
        _assert_close(f"{gname} vs F.sdpa", _np64(a), want,
                      atol=2 * t["grad"] * np.abs(want).max(), rtol=2 * t["u_out"])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sdpa_wrapper_soft_cap_sinks_window_gqa(dtype):
    """What F.sdpa lacks (sinks with grad, soft cap) with a window and GQA: reference only."""
    dt = DTYPES[dtype]
    leaves, (q, k, v), w = _bhsd_views(101, Hkv=2, dtype=dt)
    sinks = _sinks(4)
    out, _, grads = _run(lambda q, k, v: rt.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, window=12, logits_soft_cap=3.0, sinks=sinks),
        q, k, v, w, sinks)
    _check(*leaves, w.transpose(1, 2), out.transpose(1, 2), None,
           tuple(g.transpose(1, 2) for g in grads[:3]) + (grads[3],),
           ref_mask=CausalMask((48, 48)) & LocalMask((48, 48), (12, 0)), sinks=sinks,
           logits_soft_cap=3.0)


def test_sdpa_wrapper_boolean_mask_with_sinks_and_empty_rows():
    """The dense-mask path per batch element, with sinks (grad) and rows that only see the sink."""
    leaves, (q, k, v), w = _bhsd_views(111, Hkv=2)
    g = torch.Generator().manual_seed(112)
    m = torch.rand(2, 1, 48, 48, generator=g) < 0.4
    m[0, 0, 3] = False
    m[1, 0, 10:13] = False
    sinks = _sinks(4)
    out, _, grads = _run(lambda q, k, v: rt.scaled_dot_product_attention(
        q, k, v, attn_mask=m, enable_gqa=True, sinks=sinks), q, k, v, w, sinks)
    _check(*leaves, w.transpose(1, 2), out.transpose(1, 2), None,
           tuple(x.transpose(1, 2) for x in grads[:3]) + (grads[3],),
           ref_mask=np.broadcast_to(m.numpy(), (2, 4, 48, 48)), sinks=sinks)
    assert torch.all(out[0, :, 3] == 0) and torch.all(out[1, :, 10:13] == 0)


# ----------------------------------------------------------------------------- torch.compile

class _Layer(torch.nn.Module):
    """Masks, the SDPA mask and the sinks are made once, in __init__."""

    def __init__(self, S, H):
        super().__init__()
        self.mask = CausalMask((S, S)) & LocalMask((S, S), (12, 0))
        self.register_buffer("keep", torch.rand(S, S, generator=torch.Generator().manual_seed(3))
                             < 0.7)
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, H))
        self.chunked = ChunkedCausalMask((S, S), 16)

    def forward(self, q, k, v):  # q, k, v: [B, S, H, D]
        a, lse = rt.attention(q, k, v, mask=self.mask, sinks=self.sinks, logits_soft_cap=5.0,
                              return_lse=True)
        b = rt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                            v.transpose(1, 2), attn_mask=self.keep,
                                            enable_gqa=True, window=(6, 2))
        c = rt.attention(q, k, v, mask=self.chunked, layout="bshd")
        return a + b.transpose(1, 2) * 0.5 - c, lse


def test_torch_compile_fullgraph_matches_eager():
    layer = _Layer(32, 4)
    q, k, v, w = _make(121, Sq=32, Skv=32, H=4, Hkv=2, D=16, Dv=16)
    wl = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(122))
    params = (q, k, v, layer.sinks)

    def loss_and_grads(fn):
        out, lse = fn(q, k, v)
        return out, lse, torch.autograd.grad((out * w).sum() + (lse * wl).sum(), params)

    eager = loss_and_grads(layer)
    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(layer, fullgraph=True))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), eager[:2] + eager[2],
                          compiled[:2] + compiled[2]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("mask", [None, "causal"], ids=["none", "text"])
def test_torch_compile_fullgraph_default_and_text_masks(mask):
    q, k, v, _ = _make(123, B=1, Sq=32, Skv=32, H=4, Hkv=2, D=16, Dv=16)
    q, k, v = (x.detach() for x in (q, k, v))
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: rt.attention(q, k, v, mask=mask), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), rt.attention(q, k, v, mask=mask), rtol=0, atol=0)


# ----------------------------------------------------------------------------- bad inputs

def _qkv(dtype=torch.float32, layout="bshd", H=4, Hkv=2):
    q, k, v, _ = _make(0, B=1, Sq=32, Skv=32, H=H, Hkv=Hkv, D=16, Dv=16, dtype=dtype,
                       layout=layout)
    return q.detach(), k.detach(), v.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_refused():
    q, k, v = (x.cuda() for x in _qkv())
    with pytest.raises(ValueError, match=r"\bq\b: expected a CPU tensor"):
        rt.attention(q, k, v)


def _bad_attention_cases():
    q, k, v = _qkv()
    i32 = torch.int32
    return {
        # name: (call, exception, message)
        "f64": (lambda: rt.attention(q.double(), k.double(), v.double()), TypeError,
                r"q: .*float64"),
        "int": (lambda: rt.attention(q, k.to(i32), v), TypeError, r"\bk\b: .*int32"),
        "mixed_dtypes": (lambda: rt.attention(q, k, v.bfloat16()), TypeError, r"q, k, v"),
        "q_3d": (lambda: rt.attention(q[0], k, v), ValueError, r"\bq\b: expected 4 dims"),
        "v_5d": (lambda: rt.attention(q, k, v[None]), ValueError, r"\bv\b: expected 4 dims"),
        "k_head_dim": (lambda: rt.attention(q, k[..., :8], v), ValueError, r"\bk\b: .*D=16"),
        "k_batch": (lambda: rt.attention(q, torch.cat([k, k]), v), ValueError, r"\bk\b: .*B=1"),
        "v_length": (lambda: rt.attention(q, k, v[:, :16]), ValueError, r"\bv\b: .*Skv=32"),
        "heads_not_dividing": (lambda: rt.attention(torch.cat([q, q[:, :, :1]], 2), k, v),
                               ValueError, r"\bk\b: .*dividing H=5"),
        "mask_shape": (lambda: rt.attention(q, k, v, mask=CausalMask((16, 32))), ValueError,
                       r"mask: shape \(16, 32\)"),
        "multihead_mask_heads": (lambda: rt.attention(
            q, k, v, mask=MultiHeadMask([CausalMask((32, 32))] * 3)), ValueError, r"mask"),
        "mask_text": (lambda: rt.attention(q, k, v, mask="causl"), ValueError, r"causl"),
        "mask_type": (lambda: rt.attention(q, k, v, mask=3), ValueError, r"mask: expected"),
        "sinks_shape": (lambda: rt.attention(q, k, v, sinks=torch.zeros(3)), ValueError,
                        r"sinks: expected shape \[H=4\]"),
        "sinks_int": (lambda: rt.attention(q, k, v, sinks=torch.zeros(4, dtype=i32)), TypeError,
                      r"sinks"),
        "sinks_nan": (lambda: rt.attention(q, k, v, sinks=torch.full((4,), float("nan"))),
                      ValueError, r"sinks"),
        "segments_one": (lambda: rt.attention(q, k, v, q_segment_ids=torch.zeros(1, 32, dtype=i32)),
                         ValueError, r"q_segment_ids and kv_segment_ids"),
        "segments_shape": (lambda: rt.attention(q, k, v, q_segment_ids=torch.zeros(1, 32),
                                                kv_segment_ids=torch.zeros(1, 31, dtype=i32)),
                           TypeError, r"q_segment_ids"),  # float ids: a dtype error first
        "kv_segments_shape": (lambda: rt.attention(
            q, k, v, q_segment_ids=torch.zeros(1, 32, dtype=i32),
            kv_segment_ids=torch.zeros(1, 31, dtype=i32)), ValueError, r"kv_segment_ids"),
        "layout": (lambda: rt.attention(q, k, v, layout="sbhd"), ValueError, r"layout"),
        "soft_cap": (lambda: rt.attention(q, k, v, logits_soft_cap=-1.0), ValueError,
                     r"logits_soft_cap"),
        "block_sizes": (lambda: rt.attention(q, k, v, block_sizes=(100, 128)), ValueError,
                        r"block_sizes"),
        "num_threads": (lambda: rt.attention(q, k, v, num_threads=-1), ValueError,
                        r"num_threads"),
        "not_a_tensor": (lambda: rt.attention(q.numpy(), k, v), ValueError, r"\bq\b"),
    }


BAD_ATTENTION = _bad_attention_cases()


@pytest.mark.parametrize("name", list(BAD_ATTENTION))
def test_bad_inputs_attention(name):
    call, exc, match = BAD_ATTENTION[name]
    with pytest.raises(exc, match=match) as info:
        call()
    assert isinstance(info.value, rs.Error), type(info.value)


def _bad_sdpa_cases():
    q, k, v = (x.transpose(1, 2) for x in _qkv())  # [1, H=4, 32, 16], Hkv = 2
    qm, km, vm = (x.transpose(1, 2) for x in _qkv(H=4, Hkv=4))
    sdpa = rt.scaled_dot_product_attention
    ones = torch.ones(32, 32, dtype=torch.bool)
    return {
        "f64": (lambda: sdpa(qm.double(), km.double(), vm.double()), TypeError, r"query"),
        "float_mask": (lambda: sdpa(qm, km, vm, attn_mask=torch.zeros(32, 32)), ValueError,
                       r"attn_mask: only boolean masks.*express it as a boolean mask"),
        "bf16_mask": (lambda: sdpa(qm, km, vm, attn_mask=torch.zeros(32, 32, dtype=torch.bfloat16)),
                      ValueError, r"boolean"),
        "dropout": (lambda: sdpa(qm, km, vm, dropout_p=0.1), ValueError, r"dropout_p"),
        "gqa_without_enable_gqa": (lambda: sdpa(q, k, v), ValueError, r"enable_gqa"),
        "gqa_heads_not_dividing": (lambda: sdpa(torch.cat([q, q[:, :1]], 1), k, v,
                                                enable_gqa=True), ValueError, r"dividing H=5"),
        "mask_and_causal": (lambda: sdpa(qm, km, vm, attn_mask=ones, is_causal=True), ValueError,
                            r"attn_mask and is_causal"),
        "mask_shape": (lambda: sdpa(qm, km, vm, attn_mask=ones[:31]), ValueError, r"attn_mask"),
        "mask_heads": (lambda: sdpa(qm, km, vm, attn_mask=ones.expand(3, 32, 32)), ValueError,
                       r"attn_mask"),
        "mask_batch": (lambda: sdpa(qm, km, vm, attn_mask=ones.expand(2, 1, 32, 32)), ValueError,
                       r"attn_mask"),
        "mask_5d": (lambda: sdpa(qm, km, vm, attn_mask=ones[None, None, None]), ValueError,
                    r"attn_mask"),
        "window_type": (lambda: sdpa(qm, km, vm, window="wide"), ValueError, r"window"),
        "window_negative": (lambda: sdpa(qm, km, vm, window=(-4, 0)), ValueError, r"window"),
        "window_minus_one": (lambda: sdpa(qm, km, vm, window=-1), ValueError, r"window"),
        "sinks_shape_with_mask": (lambda: sdpa(qm, km, vm, attn_mask=ones, sinks=torch.zeros(3)),
                                  ValueError, r"sinks"),
        "dtypes_with_mask": (lambda: sdpa(qm, km.bfloat16(), vm, attn_mask=ones),
                             (ValueError, TypeError), r"\bk(ey)?\b"),
    }


BAD_SDPA = _bad_sdpa_cases()


@pytest.mark.parametrize("name", list(BAD_SDPA))
def test_bad_inputs_sdpa(name):
    call, exc, match = BAD_SDPA[name]
    with pytest.raises(exc, match=match) as info:
        call()
    assert isinstance(info.value, rs.Error), type(info.value)


def test_sdpa_takes_unbatched_inputs_like_pytorch():
    # [H, S, D] without a batch dim, as F.scaled_dot_product_attention takes it.
    q, k, v, _ = _make(31, B=1, Sq=32, Skv=32, H=4, Hkv=4, D=16, Dv=16, layout="bhsd")
    q, k, v = (x.detach() for x in (q, k, v))
    got = rt.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)
    want = rt.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_boolean_tensor_mask_and_no_registry_growth():
    # A boolean tensor is a dense mask of the call (nothing registered per
    # call); text masks are registered once, however often they are used.
    from ringsplash import masks as M

    q, k, v, _ = _make(32, B=1, Sq=32, Skv=32, H=4, Hkv=2, D=16, Dv=16)
    q, k, v = (x.detach() for x in (q, k, v))
    tril = torch.tril(torch.ones(32, 32, dtype=torch.bool))
    rt.attention(q, k, v, mask="local:4,0")
    rt.attention(q, k, v, mask=tril)  # registers "full", which dense masks combine with
    before = len(M._BY_ID)
    for _ in range(5):
        got = rt.attention(q, k, v, mask=tril)
        rt.attention(q, k, v, mask="local:4,0")
    assert len(M._BY_ID) == before
    torch.testing.assert_close(got, rt.attention(q, k, v, mask="causal"), rtol=0, atol=0)

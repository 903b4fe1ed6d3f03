"""Float64 NumPy reference of ringsplash's attention (SPEC sections 2 and 3).

This module is the *independent check* of the package: it is written from the
math alone and shares no code with the C++ library or with the package's own
mask machinery. Masks are evaluated here from the mask objects' documented
fields (``CausalMask.offset``, ``LocalMask.window_size`` / ``.offset``,
``ChunkedCausalMask.chunk_size``, ``NumpyMask.array``, ``MultiHeadMask.masks``,
``LogicalAnd`` / ``LogicalOr`` ``.left`` / ``.right``), recognised by class
name, so importing this file needs nothing but NumPy and the tests can load it
before the extension module exists.

Everything is dense and O(B * H * Sq * Skv): meant for small test shapes.

Layout: q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv];
out [B, Sq, H, Dv], lse [B, H, Sq]. Query head h reads key/value head
h // (H // Hkv).
"""

import numpy as np

__all__ = ["attention_reference", "attention_backward_reference", "dense_mask"]


def _eval_mask(m, qp, kp):
    """Boolean [Sq, Skv] (or [H, Sq, Skv]) of mask object ``m`` on positions.

    ``qp`` is [Sq, 1] and ``kp`` is [1, Skv], int64 global positions.
    """
    name = type(m).__name__
    if name == "FullMask":
        return np.ones(np.broadcast_shapes(qp.shape, kp.shape), dtype=bool)
    if name == "CausalMask":
        return qp + int(m.offset) >= kp
    if name == "LocalMask":
        left, right = m.window_size
        off = int(getattr(m, "offset", 0) or 0)
        allowed = np.ones(np.broadcast_shapes(qp.shape, kp.shape), dtype=bool)
        if left is not None:
            allowed &= qp + off - int(left) <= kp
        if right is not None:
            allowed &= kp <= qp + off + int(right)
        return allowed
    if name == "ChunkedCausalMask":
        c = int(m.chunk_size)
        return (qp // c == kp // c) & (qp >= kp)
    if name == "NumpyMask":
        return _index_dense(np.asarray(m.array, dtype=bool), qp, kp)
    if name == "MultiHeadMask":
        return np.stack([np.broadcast_to(_eval_mask(x, qp, kp), (qp.shape[0], kp.shape[1]))
                         for x in m.masks])
    op = getattr(m, "op", None)
    if name == "LogicalAnd" or op == "and":
        return _eval_mask(m.left, qp, kp) & _eval_mask(m.right, qp, kp)
    if name == "LogicalOr" or op == "or":
        return _eval_mask(m.left, qp, kp) | _eval_mask(m.right, qp, kp)
    raise TypeError(f"reference: unknown mask type {name}")


def _index_dense(a, qp, kp):
    """Dense [.., Sq_global, Skv_global] bool matrix read at global positions."""
    if a.ndim == 2:
        return a[qp, kp]
    if a.ndim == 3:
        return a[:, qp, kp]
    raise ValueError(f"reference: dense mask must be 2-D or 3-D, got shape {a.shape}")


def dense_mask(mask, q_positions, kv_positions):
    """Allowed pairs as a bool array [Hm, Sq, Skv] with Hm in {1, H}.

    ``mask`` is None (full), a dense bool array ([Sq, Skv] or [H, Sq, Skv],
    indexed at the global positions) or a ringsplash mask object.
    """
    qp = np.asarray(q_positions, dtype=np.int64)[:, None]
    kp = np.asarray(kv_positions, dtype=np.int64)[None, :]
    if mask is None:
        m = np.ones((qp.shape[0], kp.shape[1]), dtype=bool)
    elif isinstance(mask, np.ndarray):
        m = _index_dense(mask.astype(bool), qp, kp)
    else:
        m = _eval_mask(mask, qp, kp)
    m = np.broadcast_to(m, m.shape[:-2] + (qp.shape[0], kp.shape[1]))
    return m[None] if m.ndim == 2 else m


def _prepare(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids, kv_segment_ids,
             q_positions, kv_positions):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    B, Sq, H, D = q.shape
    _, Skv, Hkv, _ = k.shape
    assert k.shape[0] == B and v.shape[:3] == (B, Skv, Hkv) and k.shape[3] == D
    assert H % Hkv == 0, "H must be a multiple of Hkv"
    group = H // Hkv
    heads = np.arange(H) // group
    kh = k[:, :, heads, :]  # [B, Skv, H, D]   (replication is fine in a reference)
    vh = v[:, :, heads, :]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    if q_positions is None:
        q_positions = np.arange(Sq)
    if kv_positions is None:
        kv_positions = np.arange(Skv)
    allowed = dense_mask(mask, q_positions, kv_positions)[None]  # [1, Hm, Sq, Skv]
    assert allowed.shape[1] in (1, H), f"mask has {allowed.shape[1]} heads, H = {H}"
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("reference: give both q_segment_ids and kv_segment_ids or neither")
    if q_segment_ids is not None:
        qs = np.broadcast_to(np.asarray(q_segment_ids), (B, Sq))
        ks = np.broadcast_to(np.asarray(kv_segment_ids), (B, Skv))
        allowed = allowed & (qs[:, None, :, None] == ks[:, None, None, :])
    allowed = np.broadcast_to(allowed, (B, H, Sq, Skv))

    raw = scale * np.einsum("bqhd,bkhd->bhqk", q, kh)
    if logits_soft_cap is not None:
        cap = float(logits_soft_cap)
        t = np.tanh(raw / cap)
        s = cap * t
        dcap = 1.0 - t * t  # d s / d raw
    else:
        s, dcap = raw, None
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64).reshape(H)
    return dict(q=q, kh=kh, vh=vh, scale=scale, s=s, dcap=dcap, allowed=allowed, sink=sink,
                shape=(B, Sq, H, D, Skv, Hkv, group))


def _softmax(c):
    """p [B, H, Sq, Skv] (0 where not allowed) and lse [B, H, Sq] per SPEC §2."""
    s, allowed, sink = c["s"], c["allowed"], c["sink"]
    sm = np.where(allowed, s, -np.inf)
    m = sm.max(axis=-1)  # -inf on fully masked rows
    if sink is not None:
        m = np.maximum(m, sink[None, :, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, s, 0.0) - m_safe[..., None]), 0.0)
    total = e.sum(axis=-1)
    if sink is not None:
        total = total + np.exp(sink[None, :, None] - m_safe)
    nonempty = total > 0
    safe_total = np.where(nonempty, total, 1.0)
    lse = np.where(nonempty, m_safe + np.log(safe_total), -np.inf)
    p = e / safe_total[..., None]
    return p, lse


def attention_reference(q, k, v, *, mask=None, scale=None, logits_soft_cap=None, sinks=None,
                        q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                        kv_positions=None):
    """Forward attention in float64: returns (out [B, Sq, H, Dv], lse [B, H, Sq]).

    A row with no allowed key and no sink has out 0 and lse -inf; with a sink
    out 0 and lse = sinks[h]. Never NaN.
    """
    c = _prepare(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids, kv_segment_ids,
                 q_positions, kv_positions)
    p, lse = _softmax(c)
    out = np.einsum("bhqk,bkhd->bqhd", p, c["vh"])
    return out, lse


def attention_backward_reference(q, k, v, dout, *, mask=None, scale=None, logits_soft_cap=None,
                                 sinks=None, q_segment_ids=None, kv_segment_ids=None,
                                 q_positions=None, kv_positions=None):
    """Gradients in float64 of <out, dout>: returns (dq, dk, dv, dsinks).

    dsinks is None without sinks. dk / dv are summed over the query heads of
    each GQA group. Rows without allowed keys contribute nothing.
    """
    c = _prepare(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids, kv_segment_ids,
                 q_positions, kv_positions)
    B, Sq, H, D, Skv, Hkv, group = c["shape"]
    dout = np.asarray(dout, dtype=np.float64)
    p, lse = _softmax(c)
    out = np.einsum("bhqk,bkhd->bqhd", p, c["vh"])
    Di = np.einsum("bqhd,bqhd->bhq", dout, out)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, c["vh"])
    ds = p * (dp - Di[..., None])
    if c["dcap"] is not None:
        ds = ds * c["dcap"]
    scale = c["scale"]
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, c["kh"])
    dkh = scale * np.einsum("bhqk,bqhd->bkhd", ds, c["q"])
    dvh = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dk = dkh.reshape(B, Skv, Hkv, group, D).sum(axis=3)
    dv = dvh.reshape(B, Skv, Hkv, group, dvh.shape[-1]).sum(axis=3)
    dsinks = None
    if c["sink"] is not None:
        sink = np.broadcast_to(c["sink"][None, :, None], lse.shape)
        finite = np.isfinite(lse) & np.isfinite(sink)
        diff = np.where(finite, sink, 0.0) - np.where(finite, lse, 0.0)
        psink = np.where(finite, np.exp(diff), 0.0)  # exp(sink - lse), 0 for a -inf sink
        dsinks = -(psink * Di).sum(axis=(0, 2))
    return dq, dk, dv, dsinks

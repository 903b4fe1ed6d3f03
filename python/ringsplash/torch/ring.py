"""Ring splash attention over ``torch.distributed`` (SPEC §4, issue 25 item 3).

Every rank of a process group holds its slice of the sequence, in a layout's
order (``ringsplash.layouts``: "zigzag" by default, "contiguous", "striped")::

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    q, k, v = (shard_sequence(x) for x in (q, k, v))    # global [B, S, H, D] -> [B, S/N, H, D]
    out = ring_attention(q, k, v, mask=CausalMask((S, S)))      # this rank's rows
    out_global = gather_sequence(out)                             # if wanted

The forward is a ring of N steps. At step ``t`` rank ``r`` holds the key/value
slice (and kv segment ids) of source rank ``(r - t) mod N``; it runs the
block-sparse kernel of its local queries against that slice, with the
**global** positions of both slices (masks are predicates on global positions,
so windows, chunks and causality are right across shards), and merges the
partial (out, lse) in f32 with the guarded log-sum-exp merge of SPEC §2.
The slice's trip to rank ``r + 1`` (``dist.batch_isend_irecv``: send to r+1,
receive from r-1 into a second buffer) is started *before* the step's kernel,
so communication hides behind compute; the last step sends nothing. Sinks join
once, at the end; out is cast to q's dtype.

The backward (the same ``torch.autograd.Function``) is a second ring: ``dq``
accumulates locally in f32; the f32 ``dk``/``dv`` accumulators of a slice
travel with it -- the K/V slice leaves before the step's kernel, its
accumulator (plus this rank's contribution) follows right after it, and is
received by rank ``r + 1`` while that rank's next kernel runs; the send after
the last step brings every accumulator home. ``dsinks`` is computed once per
rank from (out, dout, lse) and summed with one ``all_reduce``. A gradient of
``lse`` (``return_lse=True``) enters every step as ``D_i - dlse_i``. GQA
key/value heads are never replicated.

Robustness: before the ring, one small all-gather compares a signature of the
call on every rank (shapes, dtypes, layout, mask, scale, soft cap, segment ids,
sinks, which inputs need gradients, and any argument error found locally); a
mismatch raises :class:`ringsplash.InvalidArgumentError` naming what differs on
**every** rank, instead of a hang or a silently wrong result. A rank that dies
makes its neighbours' transfers fail at once (the connection closes); a rank
that is alive but stuck (or that failed without exiting) is caught by a
timeout: ``timeout=`` (seconds or ``datetime.timedelta``) bounds every wait of
this function, otherwise the process group's own timeout applies -- set it in
``dist.init_process_group(..., timeout=datetime.timedelta(seconds=...))``
(gloo's default is 30 minutes). Either way the error is a ``RuntimeError``
that says which rank, which step and which peer. After such an error the
process group is broken (gloo closes the connection): end the process.

Every rank must call ``ring_attention`` the same number of times, and (for
training) backpropagate through every call -- as with any collective.
"""

from __future__ import annotations

import os
import datetime
import hashlib
import math
import pickle
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import layouts as _layouts
from .._errors import DTypeError, InvalidArgumentError
from .._types import as_block_sizes, as_num_threads, usable_cores
from . import _ops
from ._api import check_tensor as _check_tensor

__all__ = ["ring_attention", "shard_sequence", "gather_sequence"]


# p2p tags: K/V slices (and their segment ids) and the travelling dK/dV
# accumulators are separate message streams between the same two ranks.
_TAG_KV = 17
_TAG_ACC = 18


# --------------------------------------------------------------------------
# Process groups.

def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            "ringsplash.torch ring functions need torch.distributed: call "
            "torch.distributed.init_process_group(...) first (gloo on CPU)")
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    n = dist.get_world_size(group)
    if rank < 0:
        raise InvalidArgumentError("this process is not a member of the given process group")
    return group, rank, n


def _as_timedelta(timeout) -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    else:
        try:
            td = datetime.timedelta(seconds=float(timeout))
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"timeout: expected seconds or a datetime.timedelta, got {timeout!r}") from None
    if td.total_seconds() <= 0:
        raise InvalidArgumentError(f"timeout: expected a positive duration, got {timeout!r}")
    return td


def _wait(work, timeout):
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _fail(rank, n, what, err):
    hint = ("; the peer may have died or be stuck (set the process group's timeout with "
            "init_process_group(timeout=...) or pass timeout= to bound the wait)")
    return RuntimeError(
        f"ringsplash.torch.ring_attention: rank {rank} of {n}: {what} failed: {err}{hint}")


class _Ring:
    """The point-to-point ring of one call: send to r+1, receive from r-1."""

    def __init__(self, group, rank, n, timeout):
        self.group, self.rank, self.n, self.timeout = group, rank, n, timeout
        self.next = (rank + 1) % n
        self.prev = (rank - 1) % n
        self._next_global = dist.get_global_rank(group, self.next)
        self._prev_global = dist.get_global_rank(group, self.prev)

    def start(self, tensors, tag, step, sent, received):
        """Send ``tensors`` to rank r+1 and receive same-shaped ones from r-1
        (non-blocking); ``sent``/``received`` name them for errors. Returns
        (received buffers, pending handle for :meth:`finish`)."""
        tensors = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, b in zip(tensors, bufs):
            ops.append(dist.P2POp(dist.isend, t, self._next_global, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, b, self._prev_global, self.group, tag))
        sides = (f"sending {sent} to rank {self.next}",
                 f"receiving {received} from rank {self.prev}")
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # gloo may fail at posting time on a closed connection
            raise _fail(self.rank, self.n, f"{step}: {sides[0]} / {sides[1]}", e) from e
        return bufs, (works, len(ops), step, sides)

    def finish(self, pending):
        works, num_ops, step, sides = pending
        for i, w in enumerate(works):
            side = sides[i % 2] if len(works) == num_ops else f"{sides[0]} / {sides[1]}"
            try:
                _wait(w, self.timeout)
            except Exception as e:
                raise _fail(self.rank, self.n, f"{step}: {side}", e) from e


# --------------------------------------------------------------------------
# Merging partial results (SPEC §2), guarded against empty (lse = -inf) parts.

def _rows(x):
    """[B, H, S] -> [B, S, H, 1] to scale out [B, S, H, Dv]."""
    return x.transpose(1, 2).unsqueeze(-1)


def _merge_(out_a, lse_a, out_b, lse_b):
    """Merges (out_b, lse_b) into (out_a, lse_a) (f32); returns the new pair."""
    ninf = float("-inf")
    a_empty = lse_a == ninf
    b_empty = lse_b == ninf
    d = torch.where(a_empty | b_empty, torch.zeros_like(lse_a), lse_b - lse_a)
    lse = torch.where(a_empty, lse_b,
                      torch.where(b_empty, lse_a, lse_a + torch.nn.functional.softplus(d)))
    w = torch.where(a_empty, torch.ones_like(d),
                    torch.where(b_empty, torch.zeros_like(d), torch.sigmoid(d)))
    out_a.add_(_rows(w) * (out_b - out_a))
    return out_a, lse


def _sink_probability(sinks, lse):
    """exp(sink[h] - lse[b, h, i]) in f32, 0 where the row is empty (lse = -inf)."""
    sink = sinks.detach().to(torch.float32)[None, :, None]
    finite = lse != float("-inf")
    return torch.where(finite, torch.exp(sink - torch.where(finite, lse, 0.0)), 0.0)


def _add_sinks(out, lse, sinks):
    """lse' = logaddexp(lse, sink[h]); out' = out * exp(lse - lse') (0 where lse' = -inf)."""
    sink = sinks.detach().to(torch.float32)[None, :, None].expand_as(lse)
    lse_final = torch.logaddexp(lse, sink)
    finite = lse_final != float("-inf")
    factor = torch.where(finite, torch.exp(lse - torch.where(finite, lse_final, 0.0)), 0.0)
    return out * _rows(factor), lse_final


# --------------------------------------------------------------------------
# Validation and the cross-rank agreement check.

def _local_segments(ids, name, batch, length):
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(np.asarray(ids))
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise DTypeError(f"{name}: expected integer segment ids, got {ids.dtype}")
    if ids.dim() == 1 and ids.shape[0] == length:
        ids = ids.unsqueeze(0).expand(batch, length)
    if tuple(ids.shape) != (batch, length):
        raise InvalidArgumentError(
            f"{name}: expected this rank's slice [B, S/N] = [{batch}, {length}] (or "
            f"[{length}]), got shape {tuple(ids.shape)}")
    return ids.detach().to(torch.int32).contiguous()


def _mask_description(m) -> str:
    """A rank-independent description of a mask object (registry ids are per process):
    its type, shape, C++ text and a digest of every dense array inside it."""
    digests = []
    stack = [m]
    while stack:
        x = stack.pop()
        arr = getattr(x, "array", None)
        if isinstance(arr, np.ndarray):
            digests.append(hashlib.sha1(np.packbits(arr).tobytes()
                                        + str(arr.shape).encode()).hexdigest()[:12])
        stack.extend(reversed(getattr(x, "masks", ())))
        for side in ("right", "left"):
            if getattr(x, side, None) is not None:
                stack.append(getattr(x, side))
    desc = f"{type(m).__name__}(shape={m.shape}, '{m.core}')"
    if digests:
        desc += f" dense data {','.join(digests)}"
    return desc


def _digest(t) -> str:
    return hashlib.sha1(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:12]


class _Call:
    """The validated, rank-local facts of one call."""


def _prepare(q, k, v, rank, n, layout, mask, scale, logits_soft_cap, sinks, q_segment_ids,
             kv_segment_ids, block_sizes, num_threads, signature):
    """Validates the local arguments; fills ``signature`` (what must agree across ranks)
    as it goes, so that a failing rank still reports what it has."""
    from ..masks import as_mask

    if layout not in _layouts.LAYOUTS:
        raise InvalidArgumentError(
            f"layout: unknown sequence layout {layout!r}; expected one of "
            f"{', '.join(_layouts.LAYOUTS)}")
    signature["layout"] = layout
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(x, name, "this rank's [B, S/N, H, D] slice (4 dims)")
    signature["shapes (local q, k, v)"] = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    signature["dtypes"] = (str(q.dtype), str(k.dtype), str(v.dtype))
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, lq, h, d = q.shape
    kb, lkv, hkv, kd = k.shape
    if kb != b or v.shape[0] != b:
        raise InvalidArgumentError(
            f"q, k, v: batch sizes differ: {b}, {kb}, {v.shape[0]}")
    if kd != d:
        raise InvalidArgumentError(f"q, k: head dims differ: {d} vs {kd}")
    if tuple(v.shape[1:3]) != (lkv, hkv):
        raise InvalidArgumentError(
            f"k, v: expected the same [B, S/N, Hkv] leading shape, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}")
    if hkv < 1 or h % hkv != 0:
        raise InvalidArgumentError(
            f"q has {h} heads, k/v {hkv}: the query heads must be a multiple of the key/value "
            f"heads (GQA)")
    sq, skv = lq * n, lkv * n
    _layouts.check_divisible(layout, sq, n, "query sequence")
    _layouts.check_divisible(layout, skv, n, "key/value sequence")

    m = as_mask(mask)
    signature["mask"] = _mask_description(m)
    mshape = m.shape
    if mshape is not None and tuple(mshape[-2:]) != (sq, skv):
        raise InvalidArgumentError(
            f"mask: shape {tuple(mshape)} does not match the global sequence lengths "
            f"(Sq, Skv) = ({sq}, {skv}) (local q/kv rows {lq}/{lkv} x {n} ranks); ring masks "
            f"are built for the whole sequence, on global positions")
    m.check(h, sq, skv)

    scale_value = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    signature["scale"] = scale_value
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    signature["logits_soft_cap"] = cap
    if cap is not None and not cap > 0:
        raise InvalidArgumentError(f"logits_soft_cap: expected a value > 0, got {logits_soft_cap}")

    signature["segment ids"] = (q_segment_ids is not None, kv_segment_ids is not None)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise InvalidArgumentError("q_segment_ids and kv_segment_ids: give both or neither")
    qs = ks = None
    if q_segment_ids is not None:
        qs = _local_segments(q_segment_ids, "q_segment_ids", b, lq)
        ks = _local_segments(kv_segment_ids, "kv_segment_ids", b, lkv)

    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            signature["sinks"] = f"not a float tensor ({type(sinks).__name__})"
            raise DTypeError("sinks: expected a float tensor [H]")
        signature["sinks"] = f"shape {tuple(sinks.shape)}, values {_digest(sinks)}"
        if tuple(sinks.shape) != (h,):
            raise InvalidArgumentError(f"sinks: expected shape [H={h}], got {tuple(sinks.shape)}")
    else:
        signature["sinks"] = None

    grad = torch.is_grad_enabled()
    signature["requires_grad (q, k, v, sinks)"] = tuple(
        bool(grad and isinstance(x, torch.Tensor) and x.requires_grad)
        for x in (q, k, v, sinks))

    bs = as_block_sizes(block_sizes)
    c = _Call()
    c.layout, c.mask, c.scale = layout, m, scale_value
    c.softcap = cap if cap is not None else 0.0
    c.block_q, c.block_kv = bs.q, bs.kv
    c.num_threads = (as_num_threads(num_threads) if num_threads is not None
                     else _default_num_threads())
    c.sq, c.skv, c.lq, c.lkv = sq, skv, lq, lkv
    return c, qs, ks


def _all_gather_bytes(payload: bytes, group, n, rank, timeout):
    """All-gathers one bytes object per rank (two small collectives, bounded by timeout)."""
    def run(tensor, what):
        out = [torch.empty_like(tensor) for _ in range(n)]
        try:
            work = dist.all_gather(out, tensor, group=group, async_op=True)
            _wait(work, timeout)
        except Exception as e:
            raise _fail(rank, n, f"checking that all ranks make the same call ({what})",
                        e) from e
        return out

    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [int(s.item()) for s in run(size, "sizes")]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    datas = run(buf, "signatures")
    return [bytes(dat[:s].numpy().tobytes()) for dat, s in zip(datas, sizes)]


def _ranks(ranks) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _agree(signature, error, group, rank, n, timeout):
    """Exchanges the call's signature; raises on every rank when they differ or
    when some rank's arguments were refused."""
    payload = pickle.dumps((signature, None if error is None
                            else f"{type(error).__name__}: {error}"))
    gathered = [pickle.loads(p) for p in _all_gather_bytes(payload, group, n, rank, timeout)]
    failed = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    if failed:
        if error is not None:
            raise error
        r0, e0 = failed[0]
        others = "" if len(failed) == 1 else f" (and ranks {[r for r, _ in failed[1:]]})"
        raise InvalidArgumentError(
            f"ringsplash.torch.ring_attention: rank {r0}{others} of the process group refused "
            f"its arguments, so no rank runs the ring: {e0}")
    keys = list(signature)
    for s, _ in gathered:
        for key in s:
            if key not in keys:
                keys.append(key)
    diffs = []
    for key in keys:
        values = [s.get(key, "<missing>") for s, _ in gathered]
        if any(val != values[0] for val in values[1:]):
            groups = []  # (value, [ranks]) in order of first appearance
            for r, val in enumerate(values):
                for g in groups:
                    if g[0] == val:
                        g[1].append(r)
                        break
                else:
                    groups.append((val, [r]))
            per_rank = "; ".join(f"{_ranks(rs)}: {val}" for val, rs in groups)
            diffs.append(f"{key} differs ({per_rank})")
    if diffs:
        raise InvalidArgumentError(
            "ringsplash.torch.ring_attention: the ranks of the process group made different "
            "calls (every rank must pass the same mask, layout, shapes, dtypes, scale, soft "
            "cap, segment-id and sink arguments): " + " | ".join(diffs))


# --------------------------------------------------------------------------
# The autograd function.

def _positions(layout, seq_len, rank, n):
    return torch.from_numpy(_layouts.positions(layout, seq_len, rank, n))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, qs, ks, call, ring):
        n, rank = ring.n, ring.rank
        common = dict(mask_id=call.mask.registry_id, scale=call.scale, softcap=call.softcap,
                      block_q=call.block_q, block_kv=call.block_kv,
                      num_threads=call.num_threads)
        q_pos = _positions(call.layout, call.sq, rank, n)
        kv_send = [k.detach().contiguous(), v.detach().contiguous()]
        if ks is not None:
            kv_send.append(ks)
        out = lse = None
        for t in range(n):
            pending = None
            src = (rank - t) % n
            if t < n - 1:  # the slice leaves for rank r+1 while this step computes
                nxt, pending = ring.start(
                    kv_send, _TAG_KV, f"forward step {t + 1}/{n}",
                    f"the key/value slice of rank {src}",
                    f"the key/value slice of rank {(src - 1) % n}")
            k_cur, v_cur = kv_send[0], kv_send[1]
            ks_cur = kv_send[2] if ks is not None else None
            o, l = _ops.forward_step(
                q.detach(), k_cur, v_cur, q_segment_ids=qs, kv_segment_ids=ks_cur,
                q_positions=q_pos, kv_positions=_positions(call.layout, call.skv, src, n),
                sinks=None, out_f32=True, **common)
            if out is None:
                out, lse = o, l
            else:
                out, lse = _merge_(out, lse, o, l)
            if pending is not None:
                ring.finish(pending)
                kv_send = nxt
        if sinks is not None:
            out, lse = _add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, qs, ks, out, lse)
        ctx.call, ctx.ring, ctx.common = call, ring, common
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, qs, ks, out, lse = ctx.saved_tensors
        call, ring, common = ctx.call, ctx.ring, ctx.common
        n, rank = ring.n, ring.rank
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.to(out.dtype)
        if dlse is not None:
            dlse = dlse.to(torch.float32)

        q_pos = _positions(call.layout, call.sq, rank, n)
        kv_send = [k.detach().contiguous(), v.detach().contiguous()]
        if ks is not None:
            kv_send.append(ks)
        dq = None
        acc = acc_pending = None  # the visiting slice's f32 (dk, dv), received from r-1
        for t in range(n):
            kv_pending = None
            src = (rank - t) % n
            if t < n - 1:
                nxt, kv_pending = ring.start(
                    kv_send, _TAG_KV, f"backward step {t + 1}/{n}",
                    f"the key/value slice of rank {src}",
                    f"the key/value slice of rank {(src - 1) % n}")
            k_cur, v_cur = kv_send[0], kv_send[1]
            ks_cur = kv_send[2] if ks is not None else None
            dq_t, dk_t, dv_t, _ = _ops.backward_step(
                q.detach(), k_cur, v_cur, out, lse, dout, q_segment_ids=qs,
                kv_segment_ids=ks_cur, q_positions=q_pos,
                kv_positions=_positions(call.layout, call.skv, src, n), sinks=None,
                grads_f32=True, dlse=dlse, **common)
            dq = dq_t if dq is None else dq.add_(dq_t)
            if acc_pending is not None:
                # The slice's accumulators followed it from rank r-1 during the kernel.
                ring.finish(acc_pending)
                dk_t = acc[0].add_(dk_t)
                dv_t = acc[1].add_(dv_t)
            if n > 1:
                # Send them on after the slice; after the last step this is the trip home
                # (rank r then receives the accumulators of its own slice).
                acc, acc_pending = ring.start(
                    [dk_t, dv_t], _TAG_ACC, f"backward step {t + 1}/{n}",
                    f"the dK/dV accumulators of rank {src}"
                    + (" (home)" if t == n - 1 else ""),
                    f"the dK/dV accumulators of rank {(src - 1) % n}"
                    + (" (this rank's own, home)" if t == n - 1 else ""))
            else:
                acc = (dk_t, dv_t)
            if kv_pending is not None:
                ring.finish(kv_pending)
                kv_send = nxt
        if acc_pending is not None:
            ring.finish(acc_pending)
        dk, dv = acc

        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # dsinks[h] = -sum_{b,i} exp(sink[h] - lse[b,h,i]) (D[b,i,h] - dlse[b,h,i]) over
            # this rank's rows, then summed over the ring once.
            d_rows = (dout.to(torch.float32) * out.to(torch.float32)).sum(-1)  # [B, S, H]
            if dlse is not None:
                d_rows = d_rows - dlse.transpose(1, 2)
            dsinks = -torch.einsum("bhi,bih->h", _sink_probability(sinks, lse), d_rows)
            dsinks = dsinks.contiguous()
            if n > 1:
                try:
                    work = dist.all_reduce(dsinks, group=ring.group, async_op=True)
                    _wait(work, ring.timeout)
                except Exception as e:
                    raise _fail(rank, n, "backward, summing dsinks over the ring", e) from e
            dsinks = dsinks.to(sinks.dtype)

        need = ctx.needs_input_grad
        return (dq.to(q.dtype) if need[0] else None, dk.to(k.dtype) if need[1] else None,
                dv.to(v.dtype) if need[2] else None, dsinks, None, None, None, None)


@torch.compiler.disable
def _default_num_threads() -> int:
    """Cores this process may use, shared among the ranks torchrun put on this machine."""
    cores = usable_cores()
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_ranks = 1
    return max(1, cores // max(1, local_ranks))


def ring_attention(q, k, v, *, group=None, layout: str = "zigzag", mask=None,
                   scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                   sinks=None, q_segment_ids=None, kv_segment_ids=None,
                   return_lse: bool = False, block_sizes=None, num_threads: Optional[int] = None,
                   timeout=None):
    """Exact attention over a sequence sharded across the ranks of a process group.

    Every rank calls it with its own slice, in ``layout``'s order (see
    :func:`shard_sequence`); results equal single-process
    ``ringsplash.torch.attention`` on the whole sequence, to float rounding.

    Args:
      q: ``[B, S/N, H, D]`` this rank's query rows (float32, bfloat16, float16, CPU).
      k, v: ``[B, Skv/N, Hkv, D]`` / ``[B, Skv/N, Hkv, Dv]`` this rank's key/value rows
        (``H % Hkv == 0``: GQA/MQA, never replicated).
      group: the process group (default: WORLD); its backend needs point-to-point
        (gloo on CPU).
      layout: "zigzag" (default; balanced causal work), "contiguous" or "striped".
      mask: a ``ringsplash.masks`` mask over the GLOBAL sequence (shape ``(Sq, Skv)`` or
        ``(H, Sq, Skv)``), mask text or None (full); evaluated on global positions.
      scale: default ``1/sqrt(D)``. logits_soft_cap: ``s -> cap * tanh(s / cap)``.
      sinks: float ``[H]``, the same on every rank (may require grad; its gradient is
        summed over the ring, so every rank gets the full dsinks).
      q_segment_ids, kv_segment_ids: int ``[B, S/N]`` this rank's slices (both or neither);
        the kv ids travel with their key/value slice.
      return_lse: also return lse ``[B, H, S/N]`` float32 (differentiable).
      block_sizes: ``ringsplash.BlockSizes`` or a (q, kv) pair. num_threads: kernel threads
        (None: this rank's share of the machine: the cores this process may use divided
        by ``LOCAL_WORLD_SIZE``, the ranks torchrun starts per machine, at least 1).
      timeout: seconds (or ``datetime.timedelta``) any wait of this call (forward and
        backward) may take before it raises ``RuntimeError``; None: the process group's
        timeout (``init_process_group(timeout=...)``).

    Returns:
      out ``[B, S/N, H, Dv]`` in q's dtype (this rank's rows), or ``(out, lse)``.

    Raises:
      ringsplash.InvalidArgumentError / DTypeError on every rank when some rank's
      arguments are invalid or the ranks' calls differ (checked before the ring);
      RuntimeError when a peer dies or a wait times out.
    """
    group, rank, n = _group_info(group)
    signature = {}
    call = qs = ks = td = None
    error = None
    try:
        td = _as_timedelta(timeout)
        call, qs, ks = _prepare(q, k, v, rank, n, layout, mask, scale, logits_soft_cap, sinks,
                                q_segment_ids, kv_segment_ids, block_sizes, num_threads,
                                signature)
    except Exception as e:  # reported to every rank before anyone raises
        error = e
    if n > 1:
        _agree(signature, error, group, rank, n, td)
    elif error is not None:
        raise error
    ring = _Ring(group, rank, n, td)
    out, lse = _RingAttention.apply(q, k, v, sinks, qs, ks, call, ring)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# Layout helpers on tensors.

def _dim(x, dim):
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise InvalidArgumentError(
            f"dim {dim} is out of range for a tensor of {x.dim()} dims (shape {tuple(x.shape)})")
    return dim % x.dim()


def shard_sequence(x, group=None, layout: str = "zigzag", dim: int = 1):
    """This rank's slice of a global tensor: the rows of ``layout`` along ``dim``
    (the sequence; ``dim=1`` for ``[B, S, ...]``), in increasing global order.

    No communication: every rank passes the same global tensor. Differentiable.
    """
    _, rank, n = _group_info(group)
    d = _dim(x, dim)
    idx = torch.from_numpy(_layouts.positions(layout, x.shape[d], rank, n)).to(x.device)
    return x.index_select(d, idx)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, d, layout, group, rank, n):
        local = x.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local, group=group)
        inv = torch.from_numpy(_layouts.inverse_permutation(layout, local.shape[d] * n, n))
        ctx.d, ctx.layout, ctx.group, ctx.rank, ctx.n = d, layout, group, rank, n
        return torch.cat(parts, dim=d).index_select(d, inv.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        # Every rank's copy of the global tensor depends on this rank's rows: the
        # gradient is the sum over ranks (as torch.distributed.nn.all_gather).
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        idx = torch.from_numpy(_layouts.positions(ctx.layout, grad.shape[ctx.d], ctx.rank,
                                                  ctx.n)).to(grad.device)
        return grad.index_select(ctx.d, idx), None, None, None, None, None


def gather_sequence(x, group=None, layout: str = "zigzag", dim: int = 1):
    """The global tensor from every rank's slice (inverse of :func:`shard_sequence`):
    an all-gather along ``dim``, then back to global token order. Every rank gets it.

    Differentiable; the gradient of a rank's slice is the sum over ranks of the
    gradients of their gathered copies (as ``torch.distributed.nn.all_gather``).
    """
    group, rank, n = _group_info(group)
    d = _dim(x, dim)
    if layout not in _layouts.LAYOUTS:
        raise InvalidArgumentError(
            f"layout: unknown sequence layout {layout!r}; expected one of "
            f"{', '.join(_layouts.LAYOUTS)}")
    _layouts.check_divisible(layout, x.shape[d] * n, n)
    return _GatherSequence.apply(x, d, layout, group, rank, n)

#!/usr/bin/env python3
"""A gpt-oss-style attention layer run through ringsplash (random weights, nothing downloaded).

gpt-oss's attention is grouped-query attention (64 query heads share 8 key/value
heads in the released models; 16 and 2 here by default), head dim 64, rotary
position embeddings, a learned *sink* logit per head that joins every softmax
denominator without contributing a value, and, on every other layer, a 128-token
sliding window (each token sees itself and the 127 tokens before it; the other
layers are plain causal). This script builds one such layer in ``torch.nn`` and
runs its attention three ways on the same projected q, k, v:

  ringsplash   ringsplash.torch.scaled_dot_product_attention(..., is_causal=True,
               enable_gqa=True, window=127, sinks=layer.sinks): blocks outside the
               window are skipped.
  torch sdpa   torch.nn.functional.scaled_dot_product_attention, which has no sinks:
               they are emulated exactly, as a model must without ringsplash, by one
               extra all-zero key/value column per kv head and a float additive mask
               [1, H, S, S+1] holding 0 / -inf for the causal window and sinks[h] in
               that column. Its kernel computes every block.
  reference    the same math in float64 with plain PyTorch ops (query rows in chunks).

It prints the time of each (median of --iters runs after one warm-up) and the
largest absolute difference of each result from the float64 reference, then the
layer's output through ringsplash and its difference from the layer on SDPA.

Run (from the repository root; scripts/setup.sh installs the package into .venv):
    .venv/bin/python examples/gpt_oss_attention.py
    .venv/bin/python examples/gpt_oss_attention.py --seq 4096 --dtype bf16 --backward
    .venv/bin/python examples/gpt_oss_attention.py --layer full   # the dense layers
The defaults (S=2048, H=16, Hkv=2, D=64, f32) run in well under 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

import ringsplash.torch as rt


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, H, S, D]."""
    s, d = x.shape[2], x.shape[3]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]  # [S, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GptOssAttention(torch.nn.Module):
    """q/k/v projections with biases, RoPE, per-head sinks, GQA and an optional window."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 window: int | None, rope_theta: float = 150000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window = window  # tokens a query sees, itself included; None: all before it
        self.rope_theta = rope_theta
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden)
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.scale = 1.0 / math.sqrt(head_dim)

    def project(self, x: torch.Tensor):
        """x [B, S, hidden] -> q [B, H, S, D], k, v [B, Hkv, S, D] (views of the projections)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(q, self.rope_theta), rope(k, self.rope_theta), v

    # --- three implementations of the attention itself --------------------------------------

    def attend_ringsplash(self, q, k, v):
        window = None if self.window is None else self.window - 1
        return rt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               window=window, scale=self.scale, sinks=self.sinks)

    def sdpa_mask(self, s: int) -> torch.Tensor:
        """The float mask [1, H, S, S+1]: 0 / -inf for the causal window, sinks[h] last."""
        pos = torch.arange(s)
        allowed = pos[:, None] >= pos[None, :]
        if self.window is not None:
            allowed &= pos[:, None] - pos[None, :] < self.window
        mask = torch.zeros(1, self.heads, s, s + 1)
        mask[..., :s].masked_fill_(~allowed, -math.inf)
        mask[..., s] = self.sinks.detach()[:, None]
        return mask

    def attend_sdpa(self, q, k, v, mask=None):
        """F.sdpa with the sinks as a zero key/value column and the float mask."""
        mask = self.sdpa_mask(q.shape[2]) if mask is None else mask
        zeros = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
        return F.scaled_dot_product_attention(q, torch.cat([k, zeros], dim=2),
                                              torch.cat([v, zeros], dim=2), attn_mask=mask,
                                              scale=self.scale, enable_gqa=True)

    @torch.no_grad()
    def attend_reference(self, q, k, v, chunk: int = 256):
        """float64 plain-PyTorch attention with sinks, window and GQA."""
        q, k, v = (x.detach().double() for x in (q, k, v))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = q.shape[2]
        kv_pos = torch.arange(s)
        sinks = self.sinks.detach().double()[None, :, None, None]
        out = torch.empty(q.shape, dtype=torch.float64)
        for lo in range(0, s, chunk):
            hi = min(s, lo + chunk)
            logits = self.scale * q[:, :, lo:hi] @ k.transpose(-1, -2)  # [B, H, c, S]
            qp = torch.arange(lo, hi)[:, None]
            allowed = qp >= kv_pos[None, :]
            if self.window is not None:
                allowed &= qp - kv_pos[None, :] < self.window
            logits = logits.masked_fill(~allowed, -math.inf)
            lse = torch.logsumexp(torch.cat([logits, sinks.expand(*logits.shape[:3], 1)], -1), -1)
            out[:, :, lo:hi] = torch.exp(logits - lse[..., None]) @ v
        return out

    def forward(self, x, impl: str = "ringsplash"):
        q, k, v = self.project(x)
        o = self.attend_ringsplash(q, k, v) if impl == "ringsplash" else self.attend_sdpa(q, k, v)
        b, _, s, _ = q.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


def median_seconds(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048, help="sequence length S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024, help="model width")
    p.add_argument("--heads", type=int, default=16, help="query heads H (gpt-oss: 64)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (gpt-oss: 8)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128,
                   help="sliding window in tokens, the query included (gpt-oss: 128)")
    p.add_argument("--layer", choices=["sliding", "full"], default="sliding",
                   help="a sliding-window layer or one of the dense (causal) layers")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--iters", type=int, default=3, help="timed runs (median)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for both (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    layer = GptOssAttention(args.hidden, args.heads, args.kv_heads, args.head_dim,
                            args.window if args.layer == "sliding" else None)
    layer = layer.to(dtype)
    layer.sinks.data = layer.sinks.data.float()  # sinks stay float32 (ringsplash's dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype)
    with torch.no_grad():
        q, k, v = layer.project(x)
    print(f"gpt-oss-style {args.layer} layer: B={args.batch} S={args.seq} H={args.heads} "
          f"Hkv={args.kv_heads} D={args.head_dim} window={layer.window} {args.dtype}, "
          f"{threads} threads, {'forward+backward' if args.backward else 'forward'}")

    mask = layer.sdpa_mask(args.seq)  # built once, as a model would cache it
    impls = {"ringsplash": layer.attend_ringsplash,
             "torch sdpa": lambda q, k, v: layer.attend_sdpa(q, k, v, mask)}

    t0 = time.perf_counter()
    ref = layer.attend_reference(q, k, v)
    print(f"  {'reference (f64)':16s} {time.perf_counter() - t0:8.3f} s")
    results = {}
    for name, attend in impls.items():
        if args.backward:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            grad_out = torch.randn_like(q)

            def run():
                out = attend(*leaves)
                torch.autograd.grad(out, leaves, grad_out)
        else:
            def run():
                with torch.no_grad():
                    attend(q, k, v)
        seconds = median_seconds(run, args.iters)
        with torch.no_grad():
            results[name] = attend(q, k, v)
        diff = (results[name].double() - ref).abs().max().item()
        print(f"  {name:16s} {seconds:8.3f} s   max |out - reference| = {diff:.3g}")
    with torch.no_grad():
        y_rs, y_sdpa = layer(x, "ringsplash"), layer(x, "sdpa")
    print(f"  layer output: max |ringsplash - sdpa| = "
          f"{(y_rs.double() - y_sdpa.double()).abs().max().item():.3g} "
          f"(max |y| = {y_sdpa.abs().max().item():.3g})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Gemma-2-style attention layers run through ringsplash (random weights, nothing downloaded).

Gemma 2's attention is grouped-query attention (8 query heads share 4 key/value
heads in Gemma-2 2B), rotary position embeddings, a *soft cap* on the attention
logits (``s -> 50 * tanh(s / 50)``) and layers that alternate between a
4096-token sliding window (each token sees itself and the 4095 tokens before it)
and global causal attention. PyTorch's scaled_dot_product_attention has no soft
cap, which is why Hugging Face runs Gemma 2 with plain ("eager") attention
math. This script builds a local and a global layer in ``torch.nn`` and runs the
attention of each four ways on the same projected q, k, v:

  ringsplash   ringsplash.torch.scaled_dot_product_attention(..., is_causal=True,
               enable_gqa=True, window=W-1, logits_soft_cap=50): blocks outside the
               window are skipped.
  eager        plain PyTorch math in the layer's dtype (logits, cap, masked softmax,
               weighted sum: the full S x S matrix), what a model without ringsplash runs.
  torch sdpa   torch.nn.functional.scaled_dot_product_attention with the equivalent
               explicit boolean mask but WITHOUT the soft cap (it cannot express one):
               a timing comparison; its difference from the reference includes the cap.
  reference    the exact math in float64 with plain PyTorch ops (query rows in chunks).

It prints the time of each (median of --iters runs after one warm-up) and the
largest absolute difference of each result from the float64 reference.

The window is scaled down with the sequence by default (--seq 2048, --window 512)
so that the run takes seconds; Gemma 2's own setting is --window 4096, which
only differs from global attention beyond 4096 tokens (e.g. --seq 8192, slow on
few cores: the eager path and the reference materialise S x S logits).

Run (from the repository root; scripts/setup.sh installs the package into .venv):
    .venv/bin/python examples/gemma2_attention.py
    .venv/bin/python examples/gemma2_attention.py --dtype bf16 --backward
    .venv/bin/python examples/gemma2_attention.py --seq 8192 --window 4096 --iters 1
The defaults (S=2048, H=8, Hkv=4, D=128, f32) run in well under 30 s on 2 cores.
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
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def allowed_pairs(q_pos: torch.Tensor, kv_pos: torch.Tensor, window) -> torch.Tensor:
    """Causal, and within `window` tokens (the query included) unless window is None."""
    ok = q_pos[:, None] >= kv_pos[None, :]
    if window is not None:
        ok &= q_pos[:, None] - kv_pos[None, :] < window
    return ok


class Gemma2Attention(torch.nn.Module):
    """q/k/v projections, RoPE, GQA, logit soft cap, sliding window or global."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 window: int | None, soft_cap: float = 50.0, rope_theta: float = 10000.0,
                 query_pre_attn_scalar: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window, self.soft_cap, self.rope_theta = window, soft_cap, rope_theta
        self.scale = (query_pre_attn_scalar or head_dim) ** -0.5
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor):
        """x [B, S, hidden] -> q [B, H, S, D], k, v [B, Hkv, S, D] (views of the projections)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(q, self.rope_theta), rope(k, self.rope_theta), v

    # --- implementations of the attention itself --------------------------------------------

    def attend_ringsplash(self, q, k, v):
        window = None if self.window is None else self.window - 1
        return rt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               window=window, scale=self.scale,
                                               logits_soft_cap=self.soft_cap)

    def attend_eager(self, q, k, v, mask=None):
        """Hugging Face's eager path for Gemma 2: full logits, cap, masked softmax."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = (q @ k.transpose(-1, -2)) * self.scale
        logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        if mask is None:
            pos = torch.arange(q.shape[2])
            mask = allowed_pairs(pos, pos, self.window)
        logits = logits.masked_fill(~mask, -math.inf)
        return torch.softmax(logits.float(), dim=-1).to(q.dtype) @ v

    def attend_sdpa(self, q, k, v, mask=None):
        """F.sdpa with the same boolean mask; no soft cap (it has none)."""
        if mask is None:
            pos = torch.arange(q.shape[2])
            mask = allowed_pairs(pos, pos, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=True)

    @torch.no_grad()
    def attend_reference(self, q, k, v, chunk: int = 256):
        """float64: s = scale q.k, capped, masked softmax, weighted sum."""
        q, k, v = (x.detach().double() for x in (q, k, v))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = q.shape[2]
        kv_pos = torch.arange(s)
        out = torch.empty(q.shape, dtype=torch.float64)
        for lo in range(0, s, chunk):
            hi = min(s, lo + chunk)
            logits = self.scale * q[:, :, lo:hi] @ k.transpose(-1, -2)
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
            ok = allowed_pairs(torch.arange(lo, hi), kv_pos, self.window)
            out[:, :, lo:hi] = torch.softmax(logits.masked_fill(~ok, -math.inf), -1) @ v
        return out

    def forward(self, x):
        q, k, v = self.project(x)
        o = self.attend_ringsplash(q, k, v)
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
    p.add_argument("--hidden", type=int, default=1024, help="model width (Gemma-2 2B: 2304)")
    p.add_argument("--heads", type=int, default=8, help="query heads H (Gemma-2 2B: 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (Gemma-2 2B: 4)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (Gemma-2: 256)")
    p.add_argument("--window", type=int, default=512,
                   help="sliding window of the local layers, the query included (Gemma 2: 4096)")
    p.add_argument("--soft-cap", type=float, default=50.0, help="attention logit soft cap")
    p.add_argument("--logit-scale", type=float, default=4.0,
                   help="scales the random q projection so that logits reach the cap's range")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--iters", type=int, default=3, help="timed runs (median)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for all of them (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype)
    pos = torch.arange(args.seq)
    print(f"Gemma-2-style layers: B={args.batch} S={args.seq} H={args.heads} "
          f"Hkv={args.kv_heads} D={args.head_dim} soft cap {args.soft_cap} {args.dtype}, "
          f"{threads} threads, {'forward+backward' if args.backward else 'forward'}")
    for kind, window in (("local", args.window), ("global", None)):
        layer = Gemma2Attention(args.hidden, args.heads, args.kv_heads, args.head_dim, window,
                                args.soft_cap)
        with torch.no_grad():
            layer.q_proj.weight.mul_(args.logit_scale)
        layer = layer.to(dtype)
        with torch.no_grad():
            q, k, v = layer.project(x)
            y = layer(x)  # the whole layer on ringsplash
        assert y.shape == x.shape
        mask = allowed_pairs(pos, pos, window)  # built once, as a model would cache it
        impls = {
            "ringsplash": layer.attend_ringsplash,
            "eager": lambda q, k, v: layer.attend_eager(q, k, v, mask),
            "torch sdpa (no cap)": lambda q, k, v: layer.attend_sdpa(q, k, v, mask),
        }
        t0 = time.perf_counter()
        ref = layer.attend_reference(q, k, v)
        capped = (layer.scale * q[:, :, -256:].double()
                  @ k.double().repeat_interleave(args.heads // args.kv_heads, 1).transpose(-1, -2))
        print(f" {kind} layer (window {window}); largest |logit| of the last 256 rows "
              f"{capped.abs().max().item():.1f}")
        print(f"  {'reference (f64)':20s} {time.perf_counter() - t0:8.3f} s")
        for name, attend in impls.items():
            if args.backward:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                grad_out = torch.randn_like(q)

                def run():
                    torch.autograd.grad(attend(*leaves), leaves, grad_out)
            else:
                def run():
                    with torch.no_grad():
                        attend(q, k, v)
            seconds = median_seconds(run, args.iters)
            with torch.no_grad():
                diff = (attend(q, k, v).double() - ref).abs().max().item()
            print(f"  {name:20s} {seconds:8.3f} s   max |out - reference| = {diff:.3g}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speed of the Python package's PyTorch front-end, measured (not a test).

Prints one JSON object per line:
  torch_vs_sdpa   ringsplash.torch against torch.nn.functional.scaled_dot_product_attention
                  (CPU) on the same [B, H, S, D] tensors, B=1: S=4096 with H=8, D=128
                  (MHA) and H=16, Hkv=2, D=64 (GQA, enable_gqa=True for both), float32
                  and bfloat16, masks full / causal / window (causal & local:512,0, i.e.
                  q - 512 <= kv <= q), forward and forward+backward. SDPA runs under
                  sdpa_kernel(FLASH_ATTENTION) (its CPU flash kernel; "sdpa_backend" says
                  which ran: "default" if flash refused the inputs): full = no mask,
                  causal = is_causal=True, window = a boolean attn_mask [S, S] (SDPA has
                  no window argument; its kernel skips no block for a mask, ringsplash
                  gets window=512 and skips the blocks outside it).
                  speedup = sdpa_seconds / ringsplash_seconds (> 1: ringsplash faster).
  torch_vs_cpp    the op's own overhead: ringsplash.torch.attention (bshd, a mask object
                  built once) against the C++ `ringsplash bench` on the same shape
                  (S=4096, H=8, D=128, causal, f32; forward and forward+backward, i.e.
                  autograd through the op against --pass fwdbwd). Runs alternate (C++,
                  torch, C++, torch, ...) so load changes hit both alike; overhead =
                  median(torch) / median(C++) - 1. Target: < 5 %.
Times are medians of --iters runs after one warm-up. Both libraries get the same
thread count (--threads, default every core): torch.set_num_threads for PyTorch,
num_threads= for ringsplash, --threads-per-rank for the C++ bench.
FLOPs (useful, as `ringsplash bench` counts them): forward = 4 * B * H * D * allowed
pairs per head (two matmuls of 2 FLOPs per multiply-add; D = Dv here); backward =
2.5 x forward, so forward+backward = 3.5 x forward. gflops = FLOPs / seconds for
both libraries (the same useful FLOPs; SDPA also computes masked-out blocks).

Usage: .venv/bin/python bench/torch_bench.py [--quick] [--only torch_vs_sdpa|torch_vs_cpp]
       [--cli build/ringsplash] [--threads N] [--iters 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import ringsplash.torch as rt  # noqa: E402
from ringsplash.masks import CausalMask, LocalMask  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
WINDOW = 512


def allowed_pairs(seq: int, mask: str) -> int:
    """Allowed (q, kv) pairs per head: full S^2, causal S(S+1)/2, window sum min(i, w) + 1."""
    if mask == "full":
        return seq * seq
    if mask == "causal":
        return seq * (seq + 1) // 2
    w = min(WINDOW, seq - 1)
    return (w + 1) * seq - w * (w + 1) // 2


def median_seconds(fn, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else float("nan")


def make_inputs(seq, heads, kv_heads, dim, dtype, layout="bhsd", requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(h):
        shape = (1, h, seq, dim) if layout == "bhsd" else (1, seq, h, dim)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad)
    return r(heads), r(kv_heads), r(kv_heads), r(heads).detach()


def timer(attend, q, k, v, dout, pass_, iters):
    """Median seconds of attend(q, k, v) (fwd, no autograd) or of it and its backward."""
    if pass_ == "fwd":
        qd, kd, vd = (x.detach() for x in (q, k, v))

        def run():
            with torch.no_grad():
                attend(qd, kd, vd)
    else:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def run():
            torch.autograd.grad(attend(*leaves), leaves, dout)
    return median_seconds(run, iters)


def sdpa_case(seq, heads, kv_heads, dim, dtype, mask, pass_, args):
    q, k, v, dout = make_inputs(seq, heads, kv_heads, dim, DTYPES[dtype])
    gqa = kv_heads != heads
    if mask == "window":
        pos = torch.arange(seq)
        d = pos[:, None] - pos[None, :]
        sdpa_kw = {"attn_mask": (d >= 0) & (d <= WINDOW)}
        rs_kw = {"is_causal": True, "window": WINDOW}
    else:
        sdpa_kw = {"is_causal": mask == "causal"}
        rs_kw = dict(sdpa_kw)

    def ringsplash(q, k, v):
        return rt.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **rs_kw)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **sdpa_kw)

    def flash_sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v)

    backend = "flash"
    try:
        timer(flash_sdpa, q, k, v, dout, pass_, iters=0)  # the warm-up only: does flash run?
        sdpa_fn = flash_sdpa
    except RuntimeError:
        backend, sdpa_fn = "default", sdpa
    t_rs = timer(ringsplash, q, k, v, dout, pass_, args.iters)
    t_sdpa = timer(sdpa_fn, q, k, v, dout, pass_, args.iters)
    with torch.no_grad():
        diff = (ringsplash(q, k, v).float() - sdpa_fn(q, k, v).float()).abs().max().item()
    flops = 4.0 * heads * dim * allowed_pairs(seq, mask) * (1.0 if pass_ == "fwd" else 3.5)
    print(json.dumps({
        "bench": "torch_vs_sdpa", "pass": pass_, "seq": seq, "heads": heads,
        "kv_heads": kv_heads, "head_dim": dim, "dtype": dtype,
        "mask": {"window": f"causal & local:{WINDOW},0"}.get(mask, mask),
        "threads": args.threads, "ringsplash_seconds": t_rs, "sdpa_seconds": t_sdpa,
        "speedup": t_sdpa / t_rs, "ringsplash_gflops": flops / t_rs / 1e9,
        "sdpa_gflops": flops / t_sdpa / 1e9, "sdpa_backend": backend,
        "sdpa_mask": "attn_mask bool [S, S]" if mask == "window" else
        ("is_causal" if mask == "causal" else "none"),
        "max_abs_diff_fwd": diff, "flops": flops,
    }), flush=True)


def torch_vs_sdpa(args):
    shapes = [(args.heads, args.heads, args.dim), (args.gqa_heads, args.gqa_kv_heads,
                                                   args.gqa_dim)]
    for heads, kv_heads, dim in shapes:
        for dtype in ("f32", "bf16"):
            for mask in ("full", "causal", "window"):
                for pass_ in ("fwd", "fwdbwd"):
                    sdpa_case(args.seq, heads, kv_heads, dim, dtype, mask, pass_, args)


def cpp_seconds(args, pass_):
    cmd = [args.cli, "bench", "--seq", str(args.seq), "--heads", str(args.heads),
           "--head-dim", str(args.dim), "--mask", "causal", "--pass", pass_, "--dtype", "f32",
           "--iters", str(args.iters), "--threads-per-rank", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def torch_vs_cpp(args):
    mask = CausalMask((args.seq, args.seq))
    mask.registry_id  # registered once, outside the timed calls

    def attend(q, k, v):
        return rt.attention(q, k, v, mask=mask, num_threads=args.threads)

    q, k, v, dout = make_inputs(args.seq, args.heads, args.heads, args.dim, torch.float32,
                                layout="bshd")
    for pass_ in ("fwd", "fwdbwd"):
        timer(attend, q, k, v, dout, pass_, iters=0)  # warm-up
        cpp, tch = [], []
        for _ in range(args.rounds):
            cpp.append(cpp_seconds(args, pass_))
            tch.append(timer(attend, q, k, v, dout, pass_, args.iters))
        c, t = statistics.median(cpp), statistics.median(tch)
        print(json.dumps({
            "bench": "torch_vs_cpp", "pass": pass_, "seq": args.seq, "heads": args.heads,
            "head_dim": args.dim, "mask": "causal", "dtype": "f32", "threads": args.threads,
            "cpp_seconds": c, "torch_seconds": t, "overhead": t / c - 1.0,
            "cpp_runs": cpp, "torch_runs": tch, "target_overhead": 0.05,
            "met": t / c - 1.0 < 0.05,
        }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cli", default=os.path.join(ROOT, "build", "ringsplash"))
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds for torch_vs_cpp")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per run (median)")
    p.add_argument("--threads", type=int, default=0, help="threads for both (default: cores)")
    p.add_argument("--only", choices=["torch_vs_sdpa", "torch_vs_cpp"])
    args = p.parse_args()
    args.threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    if args.quick:
        args.seq, args.heads, args.dim = 1024, 4, 64
        args.gqa_heads, args.gqa_kv_heads, args.gqa_dim = 8, 2, 32
        args.iters, args.rounds = min(args.iters, 2), min(args.rounds, 2)
    else:
        args.seq, args.heads, args.dim = 4096, 8, 128
        args.gqa_heads, args.gqa_kv_heads, args.gqa_dim = 16, 2, 64
    if args.only in (None, "torch_vs_sdpa"):
        torch_vs_sdpa(args)
    if args.only in (None, "torch_vs_cpp"):
        if not os.path.exists(args.cli):
            print(json.dumps({"bench": "torch_vs_cpp", "skipped": f"no C++ CLI at {args.cli}"}))
        else:
            torch_vs_cpp(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speed of the Python package's JAX front-end, measured (not a test).

Prints one JSON object per line:
  jax_vs_cpp    the single-device JAX kernel (jit, one FFI call) against the C++
                `ringsplash bench` on the same shapes (default S=4096, H=8, D=128,
                causal, f32; forward and forward+backward). Runs alternate
                (C++, JAX, C++, JAX, ...) so load changes hit both alike; the
                reported overhead is median(JAX) / median(C++) - 1. Target: < 5 %.
  jax_ring      the JAX ring (make_ring_attention in shard_map) on 2 host devices
                against the single-device kernel on 1 device, each in a fresh
                process (XLA reads the device count once), S=16384 causal,
                forward. throughput_ratio = t(1 device) / t(2 devices): the ring's
                share of one device's throughput with the same cores. Target: >= 0.85.
FLOPs: forward = 4 * B * H * D * allowed pairs per head (2 matmuls of 2 FLOPs per
multiply-add), as `ringsplash bench` counts them; backward = 2.5 x forward.

Usage: .venv/bin/python bench/python_bench.py [--quick] [--cli build/ringsplash]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpp_seconds(cli, seq, heads, dim, mask, pass_, dtype, iters):
    cmd = [cli, "bench", "--seq", str(seq), "--heads", str(heads), "--head-dim", str(dim),
           "--mask", mask, "--pass", pass_, "--dtype", dtype, "--iters", str(iters)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def median_time(fn, iters):
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_single(seq, heads, dim, mask_text, pass_, dtype, iters, warmup=1):
    """Returns a callable timing the jitted JAX kernel (compiled once)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ringsplash.jax import make_splash_attention

    rng = np.random.default_rng(0)
    jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
    q, k, v = (jnp.asarray(rng.standard_normal((1, seq, heads, dim), np.float32), jdtype)
               for _ in range(3))
    kernel = make_splash_attention(mask_text)
    if pass_ == "fwd":
        fn = jax.jit(kernel)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(),
                              argnums=(0, 1, 2)))

    def run():
        jax.block_until_ready(fn(q, k, v))

    for _ in range(warmup):
        run()
    return lambda: median_time(run, iters)


def jax_vs_cpp(args):
    cases = [("fwd", "fwd"), ("fwdbwd", "fwdbwd")]
    for pass_, cli_pass in cases:
        timer = jax_single(args.seq, args.heads, args.dim, args.mask, pass_, args.dtype,
                           args.iters)
        cpp, jx = [], []
        for _ in range(args.rounds):
            cpp.append(cpp_seconds(args.cli, args.seq, args.heads, args.dim, args.mask, cli_pass,
                                   args.dtype, args.iters))
            jx.append(timer())
        c, j = statistics.median(cpp), statistics.median(jx)
        print(json.dumps({
            "bench": "jax_vs_cpp", "pass": pass_, "seq": args.seq, "heads": args.heads,
            "head_dim": args.dim, "mask": args.mask, "dtype": args.dtype,
            "cpp_seconds": c, "jax_seconds": j, "overhead": j / c - 1.0,
            "cpp_runs": cpp, "jax_runs": jx, "target_overhead": 0.05,
            "met": j / c - 1.0 < 0.05,
        }), flush=True)


RING_CHILD = r"""
import json, sys, time, statistics
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from ringsplash.jax import make_ring_attention, make_splash_attention, shard_sequence
seq, heads, dim, mask, iters, n = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, seq, heads, dim), np.float32)) for _ in range(3))
if n == 1:
    fn = jax.jit(make_splash_attention(mask))
    args = (q, k, v)
else:
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()[:n]), ("ring",))
    kernel = make_ring_attention(mask, ring_axis="ring", layout="zigzag")
    spec = P(None, "ring")
    fn = jax.jit(shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    args = tuple(shard_sequence(x, n, "zigzag") for x in (q, k, v))
jax.block_until_ready(fn(*args))
times = []
for _ in range(iters):
    t0 = time.perf_counter(); jax.block_until_ready(fn(*args)); times.append(time.perf_counter() - t0)
print(json.dumps({"devices": n, "seconds": statistics.median(times)}))
"""


def ring_seconds(n, args):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n}").strip()
    out = subprocess.run([sys.executable, "-c", RING_CHILD, str(args.ring_seq), str(args.heads_ring),
                          str(args.dim_ring), args.mask, str(args.iters), str(n)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def jax_ring(args):
    one, two = [], []
    for _ in range(args.rounds):
        one.append(ring_seconds(1, args))
        two.append(ring_seconds(2, args))
    t1, t2 = statistics.median(one), statistics.median(two)
    print(json.dumps({
        "bench": "jax_ring", "seq": args.ring_seq, "heads": args.heads_ring,
        "head_dim": args.dim_ring, "mask": args.mask, "layout": "zigzag", "dtype": "f32",
        "one_device_seconds": t1, "two_device_seconds": t2, "throughput_ratio": t1 / t2,
        "one_device_runs": one, "two_device_runs": two, "target_ratio": 0.85,
        "met": t1 / t2 >= 0.85,
    }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cli", default=os.path.join(ROOT, "build", "ringsplash"))
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per comparison")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per run (median)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--mask", default="causal")
    p.add_argument("--only", choices=["jax_vs_cpp", "jax_ring"])
    args = p.parse_args()
    args.seq, args.heads, args.dim = (1024, 4, 64) if args.quick else (4096, 8, 128)
    args.ring_seq, args.heads_ring, args.dim_ring = (2048, 2, 64) if args.quick else (16384, 8, 128)
    if args.only in (None, "jax_vs_cpp"):
        jax_vs_cpp(args)
    if args.only in (None, "jax_ring"):
        jax_ring(args)


if __name__ == "__main__":
    main()

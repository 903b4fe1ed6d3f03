#!/usr/bin/env python3
"""The measuring half of bench/scaling_model.py: its `validate` and `tiles` modes.

Runs `ringsplash bench` on in-process rings with the emulated link and compares the
model's predictions (scaling_model.py) with the measured times; see that file's
docstring and docs/SCALING.md. Run through `bench/scaling_model.py validate|tiles`.
"""
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from scaling_model import (BACKWARD_FACTOR, ROOT, Link, Problem, acc_bytes, backward_time,
                           forward_flops_per_elem, forward_time, ps_finish, slice_bytes,
                           step_work)

# ---------------------------------------------------------------------------------------
# validate mode: measured runs with the emulated link
# ---------------------------------------------------------------------------------------

CORES = os.cpu_count() or 1


def machine_info():
    cpu = "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": cpu, "cores": CORES, "kernel": platform.release()}


def load_avg():
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_bench(binary, p, n, pass_, link, iters, warmup=1, timeout=300, threads=0):
    cmd = [binary, "bench", "--seq", str(p.seq), "--heads", str(p.heads),
           "--threads-per-rank", str(threads),
           "--head-dim", str(p.head_dim), "--mask", p.mask, "--layout", p.layout,
           "--ranks", str(n), "--dtype", "f32", "--pass", pass_,
           "--block-q", str(p.block_q), "--block-kv", str(p.block_kv),
           "--warmup", str(warmup), "--iters", str(iters), "--comm-timeout", "120"]
    env = dict(os.environ)
    env.pop("RINGSPLASH_LINK", None)
    env.pop("RINGSPLASH_FAULT", None)
    if link is not None and link.active:
        env["RINGSPLASH_LINK"] = link.env()
    busy0, ours0, t0 = _host_busy(), _children_cpu(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    busy1, ours1, t1 = _host_busy(), _children_cpu(), time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (RINGSPLASH_LINK={env.get('RINGSPLASH_LINK')}) "
                           f"failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    j = lines[-1]
    # What other processes took of the machine while this one ran: the cores left to it.
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0))
    j["host"] = {"wall_s": t1 - t0, "cpu_s": ours1 - ours0, "others_cpu_s": others,
                 "cores_left": max(0.1, CORES - others / max(1e-9, t1 - t0))}
    return j, cmd, env.get("RINGSPLASH_LINK", "")


def _host_busy():
    """CPU seconds all processes of this machine have used (/proc/stat), or 0."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


def _children_cpu():
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _pass_seconds(j, pass_):
    return j["forward_seconds"] if pass_ == "fwd" else j["backward_seconds"]


@dataclass
class Calibration:
    """Compute of each step and the overheads of one configuration on THIS machine."""
    speed: float          # FLOP/s of one rank (its kernel threads) with cores of its own
    makespan: np.ndarray  # M[t]: kernel seconds of step t when the ranks share the cores
    jitter: float         # j: the slowest rank's step exceeds M[t] by j x M[t] (scheduling)
    overhead: float       # o: seconds per step outside kernels and waits (setup included)
    measured: float       # the no-link run's wall time (the pass's median)
    wake: float = 0.0     # w: how late a rank blocked on a delayed message notices it

    def step_compute(self):
        """E[t] = M[t] (1 + j): the step's compute as the ring sees it (its slowest rank)."""
        return self.makespan * (1.0 + self.jitter)


def calibrate(p, n, pass_, nolink_json, cores=CORES):
    """Compute and overheads of a configuration from its run WITHOUT link delay.

    Ranks share this machine's cores: each runs max(1, cores / N) kernel threads, so for
    N >= cores every rank has one thread and the N of them take turns on `cores` cores.
    The model of that: at step t the ranks with work compute at once and each gets
    min(1, cores / running) of a core (processor sharing, ps_finish). Rank r's kernel
    seconds summed over the steps is what the bench reports (compute_seconds[r]); fitting
    sum_t ps_finish(W[t, :] / speed)[r] to it (summed over the ranks) gives the one unknown,
    the per-thread speed, and with it M[t], the step's makespan.
    Real scheduling is not perfectly fair: within a step some ranks finish early and wait
    for the slowest (comm_wait_seconds of a run with no link delay is that wait, plus the
    real copy). The rank on the critical path is the one with the most kernel + wait
    seconds, busy = max_r(kernel_r + wait_r) (a rank idle at the last step does not wait
    for anyone: the forward's last step has no transfer). The jitter
    j = busy / sum_t M[t] - 1: in a step that waits for the link it is hidden like the rest
    of the compute. What is left of the wall time is the overhead, o = (wall - busy) / N
    per step (per-call setup: packing the slice, threads, argument agreement; wake-ups)."""
    work = step_work(p, n)
    factor = 1.0 if pass_ == "fwd" else BACKWARD_FACTOR
    w = work.elems * forward_flops_per_elem(p) * p.batch * p.heads * factor  # [t, r] FLOPs
    threads = max(1, cores // n)
    finish1 = np.array([ps_finish(w[t] / threads, cores / threads) for t in range(n)])
    kernel = np.asarray(nolink_json["compute_seconds"], dtype=np.float64)
    wait = np.asarray(nolink_json["comm_wait_seconds"], dtype=np.float64)
    speed = finish1.sum() / kernel.sum()  # FLOP/s per thread
    m = finish1.max(axis=1) / speed
    busy = float(np.max(kernel + wait))
    wall = _pass_seconds(nolink_json, pass_)
    jitter = max(0.0, busy / m.sum() - 1.0)
    overhead = max(0.0, (wall - busy) / n)
    return Calibration(speed=speed * threads, makespan=m, jitter=jitter, overhead=overhead,
                       measured=wall)


def fit_wake(p, n, pass_, cal, link, measured):
    """w from a run whose link latency hides all compute: the w at which the model gives the
    measured wall time (bisection; w >= 0). On a machine whose cores the ranks share, a
    rank blocked on a delayed message wakes only when the delivery thread that holds the
    message back gets a core again, and then the rank itself: milliseconds with 2N
    threads on 2 cores, next to nothing on a rank with cores of its own."""
    lo, hi = 0.0, max(1e-3, measured)
    if predict_measured(p, n, pass_, cal, link, wake=0.0)[0] >= measured:
        return 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if predict_measured(p, n, pass_, cal, link, wake=mid)[0] < measured:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def predict_measured(p, n, pass_, cal, link, wake=None):
    wake = cal.wake if wake is None else wake
    kvb = slice_bytes(p, n)
    e = cal.step_compute()
    if pass_ == "fwd":
        total, _, exposed = forward_time(e, kvb, link, cal.overhead, wake)
    else:
        total, _, exposed = backward_time(e, kvb, acc_bytes(p, n), link, cal.overhead, wake)
    return total, exposed


def transfer_per_step(p, n, pass_, link):
    kvb = slice_bytes(p, n)
    if pass_ == "fwd":
        return link.message(kvb)
    return link.occupy(kvb) + link.occupy(acc_bytes(p, n)) + link.latency_s


def choose_links(p, n, pass_, cal, targets, latency_s):
    """Links (latency_s, bandwidth) whose transfer per step is `targets` x the compute per
    step E (median over steps), rounded to two significant digits of GB/s."""
    e = float(np.median(cal.step_compute()[:-1]))
    kvb = slice_bytes(p, n)
    per_step = kvb if pass_ == "fwd" else kvb + acc_bytes(p, n)
    links = []
    for x in targets:
        occupy = max(1e-6, x * e - latency_s)
        bw = per_step / occupy
        bw = float(f"{bw / 1e9:.2g}") * 1e9
        links.append(Link(latency_s, bw))
    return links


VALIDATE_CASES = [("causal", "zigzag", ("fwd", "bwd")), ("causal", "contiguous", ("fwd",)),
                  ("full", "zigzag", ("fwd",))]


def validate_main(args):
    binary = args.ringsplash
    if not os.path.exists(binary):
        sys.exit(f"no ringsplash binary at {binary} (build it, or pass --ringsplash)")
    ranks = [int(x) for x in args.ranks.split(",")]
    # Default sizes: a step computes for >= ~40 ms under the core sharing (N >= 8 would
    # otherwise have steps as short as the scheduler's time slices).
    seqs = [int(x) for x in args.seq.split(",")] if args.seq else [
        16384 if n >= 8 else 8192 for n in ranks]
    heads = [int(x) for x in args.heads.split(",")] if args.heads else [
        2 if n >= 8 else 4 for n in ranks]
    if len(seqs) == 1:
        seqs *= len(ranks)
    if len(heads) == 1:
        heads *= len(ranks)
    if len(seqs) != len(ranks) or len(heads) != len(ranks):
        sys.exit("--seq and --heads: one value, or one per --ranks value")
    targets = [float(x) for x in args.targets.split(",")]
    info = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    uptime0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.time()
    out = open(args.out, "w")
    rows = []
    print(f"# {info['cpu']}, {info['cores']} cores, {date}; {uptime0}", file=sys.stderr)

    def emit(rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()
        rows.append(rec)

    # The single-core speed of each kernel (N = 1, one thread): the reference for predict.
    for mask, layout, passes in VALIDATE_CASES[:1] + VALIDATE_CASES[2:]:
        p = Problem(seq=seqs[0], heads=heads[0], head_dim=64, mask=mask, layout=layout)
        for pass_ in passes:
            j = min((run_bench(binary, p, 1, pass_, None, args.iters, threads=1)[0]
                     for _ in range(args.repeats)), key=lambda x: _pass_seconds(x, pass_))
            flops = step_work(p, 1).elems.sum() * forward_flops_per_elem(p) * p.heads * (
                1.0 if pass_ == "fwd" else BACKWARD_FACTOR)
            emit({"role": "core_speed", "date": date, "cpu": info["cpu"], "seq": p.seq,
                  "heads": p.heads, "head_dim": p.head_dim, "mask": mask, "pass": pass_,
                  "ranks": 1, "threads": 1, "seconds": _pass_seconds(j, pass_),
                  "kernel_gflops": flops / _pass_seconds(j, pass_) / 1e9,
                  "load_avg": load_avg()})
    for n, seq, h in zip(ranks, seqs, heads):
        for mask, layout, passes in VALIDATE_CASES:
            if args.quick and layout == "contiguous":
                continue
            if args.cases and f"{mask}:{layout}" not in args.cases.split(","):
                continue
            p = Problem(seq=seq, heads=h, head_dim=64, mask=mask, layout=layout)
            for pass_ in (x for x in passes if x in args.passes.split(",")):
                secs = lambda j: _pass_seconds(j, pass_)
                # A first no-link run chooses the link settings: a latency-only link whose
                # latency hides all compute (calibrates w), then bandwidths for the target
                # transfer / compute ratios. Then every setting once per round, `repeats`
                # rounds, so that a change of the machine's load falls on all settings
                # alike; the fastest run of each setting is kept.
                first = run_bench(binary, p, n, pass_, None, args.iters)[0]
                cal0 = calibrate(p, n, pass_, first)
                e0 = float(np.median(cal0.step_compute()[:-1]))
                wake_link = Link(round(args.wake_latency * e0, 4), 0.0)
                links = [Link(), wake_link] + choose_links(p, n, pass_, cal0, targets,
                                                           args.latency_us * 1e-6)
                runs = {l: [] for l in links}
                runs[links[0]].append(first)
                for rnd in range(args.repeats):
                    for l in links:
                        if rnd == 0 and not l.active:
                            continue
                        runs[l].append(run_bench(binary, p, n, pass_, l, args.iters)[0])
                best = {l: min(runs[l], key=secs) for l in links}
                cal = calibrate(p, n, pass_, best[links[0]])
                cal.wake = fit_wake(p, n, pass_, cal, wake_link, secs(best[wake_link]))
                e = float(np.median(cal.step_compute()[:-1]))
                base = {"date": date, "cpu": info["cpu"], "cores": info["cores"], "seq": p.seq,
                        "heads": p.heads, "head_dim": p.head_dim, "mask": mask,
                        "layout": layout, "ranks": n, "pass": pass_, "dtype": "f32",
                        "threads_per_rank": first["config"]["threads_per_rank"],
                        "slice_bytes": slice_bytes(p, n),
                        "acc_bytes": acc_bytes(p, n) if pass_ == "bwd" else 0,
                        "thread_gflops": cal.speed / max(1, CORES // n) / 1e9,
                        "compute_per_step_ms": e * 1e3, "jitter": cal.jitter,
                        "overhead_ms_per_step": cal.overhead * 1e3, "wake_ms": cal.wake * 1e3}
                for l in links:
                    j = best[l]
                    measured = secs(j)
                    rec = dict(base, link=l.env() if l.active else "none", load_avg=load_avg(),
                               measured_s=measured, runs_s=[secs(x) for x in runs[l]],
                               kernel_s=j["compute_seconds"], comm_wait_s=j["comm_wait_seconds"],
                               cores_left=j["host"]["cores_left"],
                               cores_left_runs=[x["host"]["cores_left"] for x in runs[l]],
                               transfer_over_compute=transfer_per_step(p, n, pass_, l) / e
                               if l.active else 0.0)
                    if l is links[0] or l is wake_link:
                        rec.update(role="calibration", predicted_s=measured, ratio=1.0)
                        emit(rec)
                        continue
                    pred, exposed = predict_measured(p, n, pass_, cal, l)
                    pred0, _ = predict_measured(p, n, pass_, cal, l, wake=0.0)
                    rec.update(role="validation", predicted_s=pred, ratio=pred / measured,
                               predicted_exposed_s=exposed, predicted_no_wake_s=pred0,
                               ratio_no_wake=pred0 / measured)
                    emit(rec)
                    print(f"N={n} {mask:6s} {layout:10s} {pass_} link {rec['link']:>12s} "
                          f"T/E={rec['transfer_over_compute']:.2f} measured {measured:.3f}s "
                          f"predicted {pred:.3f}s ({pred / measured:.3f}; w=0: "
                          f"{pred0 / measured:.3f}) load {rec['load_avg']:.1f} "
                          f"[{time.time() - started:.0f}s]", file=sys.stderr, flush=True)
    out.close()
    uptime1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    val = [r for r in rows if r["role"] == "validation"]
    print(f"# {info['cpu']}, {info['cores']} cores, {date}")
    print(f"# before: {uptime0}\n# after:  {uptime1}")
    print_validation_table(rows)
    for key in ("ratio", "ratio_no_wake"):
        if val:
            worst = max(abs(r[key] - 1) for r in val)
            within = sum(abs(r[key] - 1) <= 0.15 for r in val)
            print(f"\n{key}: {within} of {len(val)} within 15 % (worst {worst * 100:.1f} %)")
    print(f"{time.time() - started:.0f} s; wrote {args.out}")


def print_validation_table(rows):
    speeds = [r for r in rows if r["role"] == "core_speed"]
    if speeds:
        print("\nSingle-core kernel speed (N = 1, one thread):")
        for r in speeds:
            print(f"  {r['mask']} {r['pass']}: {r['kernel_gflops']:.1f} GFLOP/s "
                  f"(S = {r['seq']}, H = {r['heads']}, D = {r['head_dim']}, load {r['load_avg']:.1f})")
    print("\n| N | S, H | mask | layout | pass | link (us,GB/s) | E ms/step | o ms | w ms | j "
          "| transfer/compute | measured s | predicted s | ratio | ratio (w = 0) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["role"] == "core_speed":
            continue
        cal = r["role"] == "calibration"
        print(f"| {r['ranks']} | {r['seq']}, {r['heads']} | {r['mask']} | {r['layout']} | "
              f"{r['pass']} | {r['link']} | "
              f"{r['compute_per_step_ms']:.1f} | {r['overhead_ms_per_step']:.1f} | "
              f"{r['wake_ms']:.1f} | {r['jitter']:.2f} | {r['transfer_over_compute']:.2f} | "
              f"{r['measured_s']:.3f} | "
              + ("(calibration) | | |" if cal else
                 f"{r['predicted_s']:.3f} | {r['ratio']:.3f} | {r['ratio_no_wake']:.3f} |"))


# ---------------------------------------------------------------------------------------
# tiles mode: the exact tile counts against the kernel's
# ---------------------------------------------------------------------------------------


def tiles_main(args):
    bad = 0
    for seq, n, mask, layout in [(8192, 4, "causal", "zigzag"), (8192, 4, "causal", "contiguous"),
                                 (8192, 4, "causal", "striped"), (8192, 8, "local:1000,0", "zigzag"),
                                 (8192, 4, "local:1000,0", "striped"), (8192, 2, "full", "zigzag"),
                                 (6144, 8, "causal & local:2000,", "contiguous"),
                                 (4096, 8, "causal", "zigzag")]:
        p = Problem(seq=seq, heads=2, head_dim=16, mask=mask, layout=layout)
        j, _, _ = run_bench(args.ringsplash, p, n, "fwd", None, 1, warmup=0)
        work = step_work(p, n)
        model = int(work.tiles.sum()) * p.heads
        total = (seq // p.block_q) * (seq // p.block_kv) * p.heads  # exact for these sizes
        ok = model == j["computed_blocks"] and total - model == j["skipped_blocks"]
        bad += not ok
        print(f"S={seq} N={n} {mask:22s} {layout:10s} model {model:7d} bench "
              f"{j['computed_blocks']:7d} computed, {j['skipped_blocks']} skipped "
              f"{'ok' if ok else 'MISMATCH'}")
    sys.exit(1 if bad else 0)

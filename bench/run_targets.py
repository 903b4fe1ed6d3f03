#!/usr/bin/env python3
"""Runs the performance targets of docs/PERFORMANCE.md through `ringsplash bench`.

Every case is one or two `ringsplash bench` runs (median of --iters timed
iterations after --warmup, fraction_of_peak against the peak the same process
measures, fraction_of_bandwidth of decoding steps against the read bandwidth
it measures), the memory case under `/usr/bin/time -v`, the MPI case under
`mpirun`. Writes one JSON object per case to docs/perf/targets.jsonl:

  {"case", "date", "cpu", "load_avg" (1-minute load before the case),
   "metric", "value", "target", "pass", "runs": [the bench JSON lines]}

Usage: bench/run_targets.py [--ringsplash build/ringsplash] [--out FILE]
                            [--only CASE[,CASE...]] [--repeats N] [--quick]
The short cases run N times (default 3) as separate processes and report the
median of their metric (each run measures its own peak): on a shared machine
one process can land in a slow moment. --quick uses fewer iterations and one
repeat (a smoke test of the script, not a measurement). The 1M-token case
(million_bf16, 6-10 minutes) runs only when --only names it.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tile sizes of every run: 128 x 128 measured fastest on the reference machine
# (docs/PERFORMANCE.md); passed explicitly so the figures do not depend on the
# CLI's default.
BLOCKS = ["--block-q", "128", "--block-kv", "128"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown"


class Runner:
    def __init__(self, binary, quick, repeats):
        self.binary = binary
        self.quick = quick
        self.repeats = 1 if quick else repeats

    def iters(self, normal):
        return ["--warmup", "1", "--iters", "2" if self.quick else str(normal)]

    def bench(self, *args, iters=5, mpi_np=0, time_v=False, kernel=None):
        """Runs one bench; returns (list of JSON results, max RSS in KiB or None).
        kernel: a RINGSPLASH_KERNEL value for this run (default: kAuto)."""
        cmd = [self.binary, "bench", *args, *BLOCKS]
        if "--iters" not in args:
            cmd += self.iters(iters)
        env = dict(os.environ)
        if kernel:
            env["RINGSPLASH_KERNEL"] = kernel
            print(f"+ RINGSPLASH_KERNEL={kernel}", file=sys.stderr, flush=True)
        if mpi_np:
            cmd = ["mpirun", "--oversubscribe", "-np", str(mpi_np), *cmd]
            env.update(MPI_ENV)
        if time_v:
            cmd = ["/usr/bin/time", "-v", *cmd]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        rss = None
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        if match:
            rss = int(match.group(1))
        return runs, rss


    def auto_path(self):
        """The kernel path kAuto resolves to here (from a tiny bf16 run)."""
        if not hasattr(self, "_auto"):
            runs, _ = self.bench("--seq", "64", "--heads", "1", "--dtype", "bf16",
                                 "--warmup", "0", "--iters", "1")
            self._auto = runs[0]["kernel_path"]
        return self._auto

    def vector_kernel(self):
        """RINGSPLASH_KERNEL for the bf16 target rows: None (kAuto) unless kAuto
        is the amx path, whose bf16 forward runs its products on AMX tiles
        rather than on the vector bf16 / FMA units the targets' peak measures;
        then avx512, the vector path kAuto picks on AMX CPUs without it."""
        return "avx512" if self.auto_path() == "amx" else None


def repeated(r, metric, run_once):
    """Median of metric(runs) over r.repeats calls of run_once(), and every run."""
    values, all_runs = [], []
    for _ in range(r.repeats):
        runs = run_once()
        values.append(metric(runs))
        all_runs += runs
    return statistics.median(values), values, all_runs


def fraction_case(r, name, target, *args, kernel=None):
    """A run whose peak measurement was unreliable (fraction_of_peak null: other
    work had the cores while the peak ran; docs/CLI.md) gives no value: the
    median is over the others, and a case left with none fails."""
    values, runs = [], []
    for _ in range(r.repeats):
        rs = r.bench(*args, kernel=kernel)[0]
        runs += rs
        if rs[0]["fraction_of_peak"] is not None:
            values.append(rs[0]["fraction_of_peak"])
    value = statistics.median(values) if values else None
    return dict(case=name, metric="fraction_of_peak (median of repeats)", value=value,
                values=values, target=f">= {target}",
                passed=value is not None and value >= target, runs=runs)


# The single-device problem of the forward/backward rows: B=1, S=4096, H=Hkv=8,
# full mask, 1 rank x 2 threads.
BASE = ["--batch", "1", "--seq", "4096", "--heads", "8", "--kv-heads", "8", "--mask", "full",
        "--ranks", "1", "--threads-per-rank", "2"]
RING = ["--seq", "16384", "--heads", "8", "--kv-heads", "2", "--head-dim", "128",
        "--mask", "causal", "--layout", "zigzag", "--pass", "fwdbwd"]


def case_fwd_f32(r):
    return fraction_case(r, "fwd_f32_d128", 0.92, *BASE, "--head-dim", "128", "--dtype", "f32")


def case_fwd_bf16(r):
    return fraction_case(r, "fwd_bf16_d128", 0.82, *BASE, "--head-dim", "128", "--dtype", "bf16",
                         kernel=r.vector_kernel())


def amx_case(r, name, *extra):
    """Not a target: bf16 on the amx path against the vector path of the bf16
    target rows, alternating, and the fraction of the AMX tile peak."""
    metric = "GFLOP/s amx path / vector path (median of repeats)"
    if r.auto_path() != "amx":
        return dict(case=name, metric=metric, value=None, target="informational",
                    passed=True, error=f"no amx path here (kAuto is {r.auto_path()})")
    args = [*BASE, "--head-dim", "128", "--dtype", "bf16", *extra]
    value, values, runs = repeated(
        r, lambda rs: rs[0]["gflops"] / rs[1]["gflops"],
        lambda: r.bench(*args)[0] + r.bench(*args, kernel=r.vector_kernel())[0])
    return dict(case=name, metric=metric, value=value, values=values, target="informational",
                passed=True, runs=runs)


def case_fwd_bf16_amx(r):
    return amx_case(r, "fwd_bf16_amx_d128")


def case_bwd_bf16_amx(r):
    return amx_case(r, "bwd_bf16_amx_d128", "--pass", "bwd")


def case_fwd_f32_d64(r):
    return fraction_case(r, "fwd_f32_d64", 0.88, *BASE, "--head-dim", "64", "--dtype", "f32")


def case_bwd_f32(r):
    return fraction_case(r, "bwd_f32_d128", 0.88, *BASE, "--head-dim", "128", "--dtype", "f32",
                         "--pass", "bwd")


def case_bwd_bf16(r):
    return fraction_case(r, "bwd_bf16_d128", 0.80, *BASE, "--head-dim", "128", "--dtype", "bf16",
                         "--pass", "bwd", kernel=r.vector_kernel())


def case_causal(r):
    common = ["--seq", "8192", "--heads", "8", "--head-dim", "128", "--ranks", "1",
              "--threads-per-rank", "2", "--pass", "fwd"]
    def pair():
        return (r.bench(*common, "--mask", "full", iters=3)[0] +
                r.bench(*common, "--mask", "causal", iters=3)[0])

    value, values, runs = repeated(r, lambda rs: rs[1]["seconds"] / rs[0]["seconds"], pair)
    return dict(case="causal_vs_full_s8192", metric="causal seconds / full seconds", value=value,
                values=values, target="<= 0.55", passed=value <= 0.55, runs=runs)


def window_case(r, name, target, dtype, pass_, kernel=None):
    """Sliding window 512 (causal & local:512,0) at S=32768 against the full
    mask at S=8192, same dtype, pass and kernel path: the window's useful
    GFLOP/s over the full mask's (the bench counts only allowed pairs'
    FLOPs, docs/CLI.md), alternated in each repeat."""
    common = ["--heads", "8", "--head-dim", "128", "--ranks", "1", "--threads-per-rank", "2",
              "--pass", pass_, "--dtype", dtype]
    def pair():
        return (r.bench(*common, "--seq", "32768", "--mask", "causal&local:512,0",
                        kernel=kernel)[0] +
                r.bench(*common, "--seq", "8192", "--mask", "full", iters=3, kernel=kernel)[0])

    value, values, runs = repeated(r, lambda rs: rs[0]["gflops"] / rs[1]["gflops"], pair)
    return dict(case=name, metric="window useful GFLOP/s / full-mask GFLOP/s (S=8192)",
                value=value, values=values, target=f">= {target}", passed=value >= target,
                runs=runs)


def case_window(r):
    return window_case(r, "window512_s32768", 0.92, "f32", "fwd")


def case_window_bf16(r):
    return window_case(r, "window512_bf16_s32768", 0.85, "bf16", "fwd", kernel=r.vector_kernel())


def case_window_bwd(r):
    return window_case(r, "window512_bwd_s32768", 0.92, "f32", "bwd")


def ring_ratio(r, ring_runs):
    """Ring GFLOP/s over the 1-rank x 2-thread run of the same problem, and the
    largest fraction of an iteration any rank spent waiting for a slice."""
    single, _ = r.bench(*RING, "--ranks", "1", "--threads-per-rank", "2", iters=3)
    ring = ring_runs[0]
    value = ring["gflops"] / single[0]["gflops"]
    wait = max(w / ring["seconds"] for w in ring["comm_wait_seconds"]) if ring["seconds"] else 0
    return value, wait, single


def case_ring_threads(r):
    ring, _ = r.bench(*RING, "--ranks", "2", "--threads-per-rank", "1", iters=3)
    value, wait, single = ring_ratio(r, ring)
    imbalance = ring[0]["imbalance"]
    passed = value >= 0.90 and imbalance <= 1.05 and wait <= 0.05
    return dict(case="ring_threads_2x1", metric="ring GFLOP/s / (1 rank x 2 threads) GFLOP/s",
                value=value, target=">= 0.90, imbalance <= 1.05, comm_wait <= 5%",
                passed=passed, imbalance=imbalance, comm_wait_fraction=wait,
                runs=ring + single)


def case_ring_mpi(r):
    ring, _ = r.bench(*RING, "--backend", "mpi", "--threads-per-rank", "1", iters=3, mpi_np=2)
    value, wait, single = ring_ratio(r, ring)
    return dict(case="ring_mpi_2x1", metric="ring GFLOP/s / (1 rank x 2 threads) GFLOP/s",
                value=value, target=">= 0.85", passed=value >= 0.85,
                imbalance=ring[0]["imbalance"], comm_wait_fraction=wait, runs=ring + single)


def case_memory(r):
    # q, k, v, out (f32, [S, H=1, D=64]) and lse (f32, [H, S]) over all ranks.
    def data_bytes(s):
        return 4 * s * 64 * 4 + 4 * s

    sizes = (65536, 131072, 262144)
    results = {}
    runs = []
    for s in sizes:
        out, rss = r.bench("--seq", str(s), "--heads", "1", "--head-dim", "64", "--mask", "causal",
                           "--ranks", "4", "--layout", "zigzag", "--pass", "fwd",
                           "--warmup", "0", "--iters", "1", time_v=True)
        results[s] = rss * 1024
        runs += out
    s4, s2, s1 = sizes
    limit = 1.2 * data_bytes(s1) + 256 * 2**20
    # "Grows linearly with S": doubling S from S/2 to S adds twice what going
    # from S/4 to S/2 added (ratio 2; a term in S^2 would push it towards 4).
    # 2.2 leaves room for allocator rounding.
    growth_ratio = (results[s1] - results[s2]) / (results[s2] - results[s4])
    value = results[s1] / 2**20
    return dict(case="memory_ring4_s262144", metric="peak RSS MiB (/usr/bin/time -v)",
                value=value, target=f"<= {limit / 2**20:.0f} MiB (1.2 x data + 256 MiB), "
                                    "linear growth (RSS step ratio per doubling <= 2.2)",
                passed=results[s1] <= limit and growth_ratio <= 2.2,
                rss_mib={str(s): v / 2**20 for s, v in results.items()},
                data_mib=data_bytes(s1) / 2**20, growth_ratio=growth_ratio,
                growth_per_data_byte=(results[s1] - results[s2]) / (data_bytes(s1) - data_bytes(s2)),
                runs=runs)


def case_decode(r):
    """Not a target: one decoding token against a 32768-key cache, GQA (H=32,
    Hkv=4, D=128, f32, 2 threads): bound by reading K and V, so the metric is
    their bytes over the step's seconds (docs/PERFORMANCE.md, Decoding)."""
    kv_bytes = 2 * 32768 * 4 * 128 * 4

    def once():
        runs, _ = r.bench("--q-seq", "1", "--seq", "32768", "--heads", "32", "--kv-heads", "4",
                          "--head-dim", "128", "--ranks", "1", "--threads-per-rank", "2",
                          iters=21)
        return runs

    value, values, runs = repeated(r, lambda rs: kv_bytes / rs[0]["seconds"] / 1e9, once)
    return dict(case="decode_gqa_s32768", metric="K/V GB/s read by a decoding step (median)",
                value=value, values=values, target="informational", passed=True, runs=runs)


def case_decode_mha(r):
    """Not a target: the same step with MHA (H = Hkv = 32: 1 GiB of f32 K and
    V, every head its own rows), read from the bench's kv_gb_per_s."""
    def once():
        runs, _ = r.bench("--q-seq", "1", "--seq", "32768", "--heads", "32", "--kv-heads", "32",
                          "--head-dim", "128", "--ranks", "1", "--threads-per-rank", "2",
                          iters=11)
        return runs

    value, values, runs = repeated(r, lambda rs: rs[0]["kv_gb_per_s"], once)
    return dict(case="decode_mha_s32768", metric="K/V GB/s read by a decoding step (median)",
                value=value, values=values, target="informational", passed=True, runs=runs)


def bandwidth_case(r, name, dtype):
    """One decoding token, GQA H=32 over Hkv=8 (4 query rows per kv head),
    D=128, Skv=32768 (128 MiB of bf16 K/V, 256 MiB of f32), 1 rank x 2
    threads: the K/V read rate over the read bandwidth the same process
    measures (fraction_of_bandwidth, docs/CLI.md). As fraction_case: a run
    whose bandwidth measurement was unreliable (null: the step read faster
    than the probe) gives no value, and a case left with none fails."""
    values, runs = [], []
    for _ in range(r.repeats):
        rs, _ = r.bench("--q-seq", "1", "--seq", "32768", "--heads", "32", "--kv-heads", "8",
                        "--head-dim", "128", "--dtype", dtype, "--ranks", "1",
                        "--threads-per-rank", "2", iters=21)
        runs += rs
        if rs[0]["fraction_of_bandwidth"] is not None:
            values.append(rs[0]["fraction_of_bandwidth"])
    value = statistics.median(values) if values else None
    return dict(case=name, metric="fraction_of_bandwidth (median of repeats)", value=value,
                values=values, target=">= 0.8", passed=value is not None and value >= 0.8,
                runs=runs)


def case_decode_bw_bf16(r):
    return bandwidth_case(r, "decode_gqa8_bf16_bw", "bf16")


def case_decode_bw_f32(r):
    return bandwidth_case(r, "decode_gqa8_f32_bw", "f32")


def case_million_bf16(r):
    """A 1,048,576-token causal bf16 forward (H=1, D=64) through a zigzag ring
    of 2 in-process ranks x 1 thread, one iteration: 6-10 minutes, so only
    with --only (OPTIONAL)."""
    runs, rss = r.bench("--seq", "1048576", "--heads", "1", "--kv-heads", "1", "--head-dim", "64",
                        "--dtype", "bf16", "--mask", "causal", "--ranks", "2",
                        "--threads-per-rank", "1", "--layout", "zigzag", "--pass", "fwd",
                        "--warmup", "0", "--iters", "1", time_v=True, kernel=r.vector_kernel())
    value = runs[0]["seconds"]
    return dict(case="million_bf16_ring2", metric="seconds, one forward", value=value,
                target="<= 370", passed=value <= 370, peak_rss_mib=rss / 1024 if rss else None,
                runs=runs)


CASES = {
    "fwd_f32": case_fwd_f32,
    "fwd_bf16": case_fwd_bf16,
    "fwd_bf16_amx": case_fwd_bf16_amx,
    "fwd_f32_d64": case_fwd_f32_d64,
    "bwd_f32": case_bwd_f32,
    "bwd_bf16": case_bwd_bf16,
    "bwd_bf16_amx": case_bwd_bf16_amx,
    "causal": case_causal,
    "window": case_window,
    "window_bf16": case_window_bf16,
    "window_bwd": case_window_bwd,
    "ring_threads": case_ring_threads,
    "ring_mpi": case_ring_mpi,
    "memory": case_memory,
    "decode": case_decode,
    "decode_mha": case_decode_mha,
    "decode_bw_bf16": case_decode_bw_bf16,
    "decode_bw_f32": case_decode_bw_f32,
    "million_bf16": case_million_bf16,
}
# Run only when named in --only: too long for the default pass.
OPTIONAL = {"million_bf16"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ringsplash", default=os.path.join(ROOT, "build", "ringsplash"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf", "targets.jsonl"))
    ap.add_argument("--only", default="", help="comma list of: " + ",".join(CASES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or [n for n in CASES if n not in OPTIONAL]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {','.join(CASES)}")
    runner = Runner(a.ringsplash, a.quick, a.repeats)
    cpu = cpu_name()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    failures = 0
    # Rows go to a temporary file as they finish (a crash leaves the old
    # table whole); with --only, the old table's other rows are kept.
    partial = a.out + ".partial"
    with open(partial, "w") as out:
        for name in names:
            load = os.getloadavg()[0]
            try:
                result = CASES[name](runner)
            except RuntimeError as e:
                result = dict(case=name, error=str(e), passed=False)
            result = dict(case=result.pop("case"), date=datetime.date.today().isoformat(),
                          cpu=cpu, load_avg=round(load, 2), **result)
            result["pass"] = result.pop("passed")
            failures += 0 if result["pass"] else 1
            out.write(json.dumps(result) + "\n")
            out.flush()
            value = result.get("value")
            print(f"{result['case']:24s} {result.get('metric', ''):55s} "
                  f"{value if value is None else round(value, 3)!s:>8s}  "
                  f"{result.get('target', '')}  "
                  f"{'INFO' if result.get('target') == 'informational' else 'PASS' if result['pass'] else 'MISS'}"
                  f"  (load {load:.2f})", flush=True)
    merge_rows(a.out, partial, keep_others=bool(a.only))
    return 1 if failures else 0


def merge_rows(path, partial, keep_others):
    """Moves the new rows in `partial` to `path`. With keep_others, `path`'s
    rows of other cases stay, in their places; a re-run case's row takes the
    place of its old one (new cases go at the end)."""
    with open(partial) as f:
        new = [json.loads(line) for line in f if line.strip()]
    rows = []
    if keep_others and os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    by_case = {r["case"]: r for r in new}
    merged = [by_case.pop(r["case"], r) for r in rows]
    merged += [r for r in new if r["case"] in by_case]
    with open(partial, "w") as f:
        for r in merged:
            f.write(json.dumps(r) + "\n")
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())

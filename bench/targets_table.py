#!/usr/bin/env python3
"""Prints docs/perf/targets.jsonl (bench/run_targets.py) as a Markdown table.

Usage: bench/targets_table.py [targets.jsonl] > table.md
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "fwd_f32_d128": "forward f32, B=1 S=4096 H=Hkv=8 D=128, full, 1 rank x 2 threads",
    "fwd_bf16_d128": "forward bf16, same (vector path: kAuto's, or avx512 where kAuto is amx)",
    "fwd_bf16_amx_d128": "forward bf16, same, amx path vs vector path (not a target)",
    "fwd_f32_d64": "forward f32, same, D=64",
    "bwd_f32_d128": "backward f32 (`--pass bwd`), S=4096 D=128",
    "bwd_bf16_d128": "backward bf16, same (vector path)",
    "bwd_bf16_amx_d128": "backward bf16, same, amx path vs vector path (not a target)",
    "causal_vs_full_s8192": "causal vs full, S=8192, f32 forward",
    "window512_s32768": "sliding window `causal&local:512,0`, S=32768, f32 forward: "
                        "GFLOP/s over the full mask's (S=8192)",
    "window512_bf16_s32768": "same, bf16 forward (vector path)",
    "window512_bwd_s32768": "same, f32 backward",
    "ring_threads_2x1": "ring, threads, 2 ranks x 1 thread, S=16384 H=8 Hkv=2 causal zigzag fwdbwd",
    "ring_mpi_2x1": "ring, MPI, 2 processes x 1 thread, same",
    "memory_ring4_s262144": "memory, causal zigzag ring of 4, S=262144 H=1 D=64, fwd",
    "decode_gqa_s32768": "decoding step, 1 token, Skv=32768 H=32 Hkv=4 D=128 f32 (not a target)",
    "decode_mha_s32768": "decoding step, same with MHA (H=Hkv=32) (not a target)",
    "decode_gqa8_bf16_bw": "decoding step, 1 token, Skv=32768 H=32 Hkv=8 D=128 bf16: "
                           "K/V read rate / measured read bandwidth",
    "decode_gqa8_f32_bw": "decoding step, same, f32",
    "million_bf16_ring2": "1,048,576-token causal bf16 forward, H=1 D=64, zigzag ring of 2 "
                          "in-process ranks x 1 thread (seconds)",
}


def fmt(x, digits=3):
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def detail(r):
    """What the measured value is made of, per case."""
    runs = r.get("runs", [])
    case = r["case"]
    if "values" in r:
        spread = "runs " + ", ".join(fmt(v) for v in r["values"])
    else:
        spread = ""
    if "_amx" in case:
        amx, vec = runs[0], runs[1]
        if amx.get("fraction_of_amx_peak") is None:  # peak_unreliable: no fractions
            return (f"{spread}; {amx['gflops']:.0f} vs {vec['gflops']:.0f} GFLOP/s; "
                    "peak measurement unreliable")
        return (f"{spread}; {amx['gflops']:.0f} vs {vec['gflops']:.0f} GFLOP/s; "
                f"{amx['fraction_of_amx_peak']:.3f} of the AMX tile peak "
                f"({amx['amx_peak_gflops']:.0f} GFLOP/s), {amx['fraction_of_peak']:.2f} x the "
                "vector peak")
    if case.startswith(("fwd", "bwd")):
        # The median run's own figures (medians taken apart would not divide
        # to the reported fraction).
        # Runs whose peak was unreliable (fraction_of_peak null) have no fraction.
        measured = [run for run in runs if run.get("fraction_of_peak") is not None]
        if not measured or r["value"] is None:
            return f"{spread}; every run's peak measurement was unreliable"
        med = min(measured, key=lambda run: abs(run["fraction_of_peak"] - r["value"]))
        return (f"{spread}; {med['gflops']:.0f} of {med['peak_gflops']:.0f} GFLOP/s (median run); "
                f"path {med.get('kernel_path', '?')}")
    if case.startswith("causal"):
        return f"{spread}; seconds {runs[0]['seconds']:.2f} full, {runs[1]['seconds']:.2f} causal"
    if case.startswith("window"):
        return (f"{spread}; {runs[0]['gflops']:.0f} vs {runs[1]['gflops']:.0f} GFLOP/s")
    if case.startswith("ring"):
        return (f"{runs[0]['gflops']:.0f} vs {runs[1]['gflops']:.0f} GFLOP/s; imbalance "
                f"{r['imbalance']:.3f}; max comm wait {100 * r['comm_wait_fraction']:.1f} % of an "
                "iteration")
    if case.endswith("_bw"):
        # The median run's own figures, as for the peak rows.
        measured = [run for run in runs if run.get("fraction_of_bandwidth") is not None]
        if not measured or r["value"] is None:
            return f"{spread}; every run's bandwidth measurement was unreliable"
        med = min(measured, key=lambda run: abs(run["fraction_of_bandwidth"] - r["value"]))
        return (f"{spread}; {med['kv_gb_per_s']:.1f} of {med['read_gb_per_s']:.1f} GB/s "
                f"(median run; {med['bandwidth_method']}, {med['bandwidth_threads']} threads), "
                f"{med['seconds'] * 1e3:.1f} ms per step, {med['kv_bytes'] / 2**20:.0f} MiB of "
                f"K and V; path {med.get('kernel_path', '?')}")
    if case.startswith("decode"):
        ms = sorted(run["seconds"] * 1e3 for run in runs)
        mib = runs[0].get("kv_bytes", 128 * 2**20) / 2**20
        return f"{spread}; {ms[len(ms) // 2]:.1f} ms per step (median), {mib:.0f} MiB of K and V"
    if case.startswith("million"):
        run = runs[0]
        rss = r.get("peak_rss_mib")
        return (f"{run['gflops']:.0f} GFLOP/s, {run.get('fraction_of_peak') or 0:.2f} of peak; "
                f"peak RSS {rss / 1024:.1f} GiB" if rss else f"{run['gflops']:.0f} GFLOP/s")
    if case.startswith("memory"):
        rss = r["rss_mib"]
        steps = ", ".join(f"{v:.0f} MiB at S={s}" for s, v in rss.items())
        return (f"RSS {steps}; data {r['data_mib']:.0f} MiB; step ratio per doubling "
                f"{r['growth_ratio']:.2f}; growth {r['growth_per_data_byte']:.2f} x data "
                "(two kv slice buffers per rank: 1.0 x data)")
    return spread


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "perf", "targets.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| case | target | measured | met | load | detail |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        value = r.get("value")
        informational = r.get("target") == "informational"
        if value is None:  # an informational row with nothing to measure here, or a failure
            measured = "n/a" if informational and r.get("pass") else "error"
        else:
            measured = fmt(value, 1 if value > 10 else 3)
        met = "—" if informational else "yes" if r["pass"] else "**no**"
        print(f"| {CASES.get(r['case'], r['case'])} | {r.get('target', '')} | {measured} | "
              f"{met} | {r['load_avg']} | "
              f"{detail(r) if value is not None else r.get('error', '')[:80]} |")


if __name__ == "__main__":
    main()

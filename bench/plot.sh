#!/usr/bin/env bash
# GFLOP/s versus sequence length for the single-device forward and backward,
# f32 and bf16, against the peak the same runs measured:
#   docs/perf/gflops_vs_seq.jsonl  the `ringsplash bench` JSON lines
#   docs/perf/gflops_vs_seq.png    the plot (gnuplot, Debian gnuplot-nox)
# B=1, H=8, D=128, full mask, 1 rank x 2 threads, block sizes 128 x 128.
# `bench/plot.sh --no-run` re-plots the existing JSON. RINGSPLASH picks the
# binary (default build/ringsplash). Takes ~5 minutes on 2 cores: run it on an
# otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${RINGSPLASH:-build/ringsplash}"
out=docs/perf
json="$out/gflops_vs_seq.jsonl"
mkdir -p "$out"

if [ "${1:-}" != "--no-run" ]; then
  : >"$json"
  for pass in fwd bwd; do
    for dtype in f32 bf16; do
      echo "+ $bin bench --seq 1024,2048,4096,8192 --pass $pass --dtype $dtype" >&2
      "$bin" bench --seq 1024,2048,4096,8192 --batch 1 --heads 8 --head-dim 128 --mask full \
        --ranks 1 --threads-per-rank 2 --pass "$pass" --dtype "$dtype" \
        --block-q 128 --block-kv 128 --warmup 1 --iters 3 >>"$json"
    done
  done
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# One data file per (pass, dtype): seq gflops peak; peaks also as medians.
python3 - "$json" "$tmp" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
peaks, paths = {}, {}
for r in rows:
    c = r["config"]
    name = f'{c["pass"]}_{c["dtype"]}'
    with open(f"{sys.argv[2]}/{name}.dat", "a") as f:
        f.write(f'{c["seq"]} {r["gflops"]:.2f} {r["peak_gflops"]:.2f}\n')
    peaks.setdefault(c["dtype"], []).append(r["peak_gflops"])
    paths[name] = r["kernel_path"]
with open(f"{sys.argv[2]}/peaks.gp", "w") as f:
    for dtype, values in peaks.items():
        f.write(f"peak_{dtype} = {statistics.median(values):.2f}\n")
    for name, path in paths.items():
        f.write(f'path_{name} = "{path}"\n')
EOF

gnuplot <<EOF
load "$tmp/peaks.gp"
# noenhanced: path names such as avx512_bf16 are text, not subscripts.
set terminal pngcairo size 900,560 font "sans,11" noenhanced
set output "$out/gflops_vs_seq.png"
set title "ringsplash single-device attention, B=1 H=8 D=128, full mask, 2 threads\n$(lscpu | sed -n 's/^Model name: *//p')"
set xlabel "sequence length S (= Sq = Skv)"
set ylabel "useful GFLOP/s"
set logscale x 2
set xrange [768:11000]
set yrange [0:*]
set key bottom right
set grid
plot "$tmp/fwd_f32.dat" using 1:2 with linespoints lw 2 pt 7 title sprintf("forward f32 (%s)", path_fwd_f32), \
     "$tmp/fwd_bf16.dat" using 1:2 with linespoints lw 2 pt 5 title sprintf("forward bf16 (%s)", path_fwd_bf16), \
     "$tmp/bwd_f32.dat" using 1:2 with linespoints lw 2 pt 9 title sprintf("backward f32 (%s)", path_bwd_f32), \
     "$tmp/bwd_bf16.dat" using 1:2 with linespoints lw 2 pt 11 title sprintf("backward bf16 (%s)", path_bwd_bf16), \
     peak_f32 with lines dt 2 lw 2 lc rgb "black" title sprintf("f32 FMA peak (measured) %.0f", peak_f32), \
     peak_bf16 with lines dt 3 lw 2 lc rgb "gray40" title sprintf("bf16 vector peak (measured) %.0f", peak_bf16)
EOF
echo "wrote $out/gflops_vs_seq.png from $json"

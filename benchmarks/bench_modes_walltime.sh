#!/usr/bin/env bash
# Wall time of the embedded preset, zero-shot against text-only (the aim: zero-shot at most +10%).
# Runs stages -1..5 of each mode four times in a row, interleaved text-only, zero-shot, zero-shot,
# text-only (ABBA: a machine that drifts slower or faster through the hour weighs on both modes
# alike), each in its own EXP_DIR under OUT; prints each run's seconds and stage times, then the
# ratio of the means. Run it in a fresh clone after `bash run.sh -2 -2`, on an idle machine (about
# an hour on 2 cores; docs/results.md, 2026-12-04 night, has a run).
#   bash benchmarks/bench_modes_walltime.sh [OUT]      OUT default exp/walltime
#   STAGES="0 0" bash benchmarks/bench_modes_walltime.sh /tmp/w   other stages (a quick look)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-exp/walltime}
read -r first last <<< "${STAGES:--1 5}"
mkdir -p "$OUT"
secs=()
for run in textonly1 zeroshot1 zeroshot2 textonly2; do
  # zero-shot: PROMPT_POOL unset, so presets/embedded.sh's default pool applies; text-only: set empty
  mode=(env -u PROMPT_POOL)
  [[ $run == textonly* ]] && mode=(env PROMPT_POOL=)
  t0=$(date +%s.%N)
  "${mode[@]}" EXP_DIR="$OUT/$run" bash run.sh "$first" "$last" > "$OUT/$run.log" 2>&1 ||
    { echo "$run failed: $OUT/$run.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  s=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$t1")
  echo "$run: $s s (stages $first..$last; $(grep -o 'stage -\{0,1\}[0-9] done in [0-9]*s' "$OUT/$run.log" | paste -sd, -))"
  secs+=("$s")
done
python3 - "${secs[@]}" <<'PY'
import sys
t = [float(x) for x in sys.argv[1:]]
a, b = (t[0] + t[3]) / 2, (t[1] + t[2]) / 2
print(f"text-only mean {a:.1f} s, zero-shot mean {b:.1f} s: zero-shot {100 * (b / a - 1):+.1f}% "
      f"(each zero-shot run against the later text-only one: {100 * (t[1] / t[3] - 1):+.1f}%, "
      f"{100 * (t[2] / t[3] - 1):+.1f}%)")
PY

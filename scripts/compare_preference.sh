#!/usr/bin/env bash
# The embedded comparison of DPO losses (README "DPO / cDPO / IPO (+SFT) and KTO"): every variant
# of VARIANTS x every seed of SEEDS trains on the SAME mined pairs (mined once, by the first run,
# into COMPARE_DIR/base/pairs/pairs.parquet) from one start model, one data split and one reward
# server, for the preset's steps (PREF_ARGS: 3 epochs, a step saved every 10); stage 4 scores every
# saved step (dev + test, CER and, zero-shot, SIM with 95% intervals). Then a table per run:
# start and last step, test CER (utt-mean) and SIM with their intervals. A run whose
# dpo/eval/summary.json exists is kept, so the command resumes after a crash.
# The variants (PREF_EXTRA words over the preset's PREF_ARGS, which train sigmoid at beta 0.1):
#   sigmoid       DPO as published (summed log-probs): the reference
#   sigmoid_norm  per-token mean log-ratios (CosyVoice2's and Tulu 3's averaging): a rejected long,
#                 rambling utterance no longer wins the sum by its length; beta 5 as Tulu 3's
#                 length-normalised DPO, since per-token log-ratios are ~1/length of the sums
#   ipo           IPO (TRL averages it per token): a bounded target margin 1/(2 beta) instead of
#                 pushing margins without end on a few hundred pairs, some mined at a 0.01 margin
#   ld0.5         LD-DPO, ld_alpha 0.5: the tail past the shorter completion weighted by half
# Settings (environment): COMPARE_DIR (exp/compare_pref), VARIANTS (sigmoid sigmoid_norm ipo ld0.5),
#   SEEDS (1 2: TRL's data order); PRESET and anything run.sh reads apply to every run.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
: "${COMPARE_DIR:=exp/compare_pref}" "${VARIANTS:=sigmoid sigmoid_norm ipo ld0.5}" "${SEEDS:=1 2}"
declare -A EXTRA=([sigmoid]="" [sigmoid_norm]="--loss-type sigmoid_norm --beta 5"
                  [ipo]="--loss-type ipo --beta 0.5" [ld0.5]="--ld-alpha 0.5")
BASE=$COMPARE_DIR/base
start=$SECONDS
for variant in $VARIANTS; do
  [[ -v "EXTRA[$variant]" ]] || { echo "unknown variant $variant (known: ${!EXTRA[*]})" >&2; exit 2; }
done
TRAINER=dpo EXP_DIR=$BASE bash run.sh -2 1   # install, start model, data, reward server (left running)
for seed in $SEEDS; do
  for variant in $VARIANTS; do
    run=$COMPARE_DIR/$variant-seed$seed
    if [[ -f $run/dpo/eval/summary.json ]]; then echo "== $run: scored already, kept"; continue; fi
    rm -rf "$run"
    echo "== $run ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$COMPARE_DIR/runs.log"
    TRAINER=dpo EXP_DIR=$run HF_MODEL_DIR=$BASE/hf_model DATA_DIR=$BASE/data PAIRS_FILE=$BASE/pairs/pairs.parquet \
      PREF_EXTRA="${EXTRA[$variant]} --seed $seed" bash run.sh 2 4
    echo "   done $(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$COMPARE_DIR/runs.log"
  done
done
if [[ -f $BASE/reward_server.pid ]]; then kill "$(cat "$BASE/reward_server.pid")" 2>/dev/null || true; rm -f "$BASE/reward_server.pid"; fi
.venv/bin/python - "$COMPARE_DIR" "$VARIANTS" "$SEEDS" <<'EOF' | tee "$COMPARE_DIR/compare.md"
import json, sys
from pathlib import Path

root, variants, seeds = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
pct = lambda x: f"{100 * x:.2f}"
print("| variant | seed | test set | start CER | last step | CER [95% CI] | SIM [95% CI] |\n|---|---|---|---|---|---|---|")
for v in variants:
    for s in seeds:
        rows = json.loads((root / f"{v}-seed{s}" / "dpo" / "eval" / "summary.json").read_text())
        for name in dict.fromkeys(r["test_set"] for r in rows if r.get("role", "test") == "test"):
            mine = sorted((r for r in rows if r["test_set"] == name), key=lambda r: r["step"])
            first, last = mine[0], mine[-1]
            lo, hi = last["ci"]["cer_utt_mean"]
            sim = (f"{last['sim_mean']:.4f} [{last['sim_ci'][0]:.4f}, {last['sim_ci'][1]:.4f}]"
                   if last.get("sim_mean") is not None else "-")
            print(f"| {v} | {s} | {name} | {pct(first['cer_utt_mean'])} | {last['step']} | "
                  f"{pct(last['cer_utt_mean'])} [{pct(lo)}, {pct(hi)}] | {sim} |")
EOF
echo "compare_preference.sh: done in $(( SECONDS - start )) s; table: $COMPARE_DIR/compare.md"

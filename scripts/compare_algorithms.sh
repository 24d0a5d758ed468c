#!/usr/bin/env bash
# The embedded comparison of the GRPO variants (README "Which algorithm when"): every
# algorithm of ALGORITHMS x every seed of SEEDS trains STEPS steps from one start model, on one
# data split, against one reward server, and stage 4 scores every saved step (dev + test, the
# preset's sampling rule); then `python -m ttsrl.eval.compare` writes the table at an equal
# wall-clock budget (compare.md, compare.json). A run whose eval/summary.json exists is kept, so
# the command resumes after a crash. Settings (environment):
#   COMPARE_DIR  where everything goes (exp/compare): base/ (start model, data), ALGO-seedS/
#   ALGORITHMS   the variants (grpo grpo_no_std dapo rloo gspo); ALGORITHM+WEIGHTS trains that
#                algorithm on a named reward weighting (REWARD_WEIGHTS) against its own reward server
#                (port REWARD_PORT + k): the zero-shot comparison is
#                ALGORITHMS="grpo grpo+glm_tts gdpo" (CER only, CER + 0.1 SIM, gdpo on cer/sim/length)
#   SEEDS        (1 2)   STEPS (20)   SAVE_FREQ (5)   BUDGET_S (empty: ttsrl.eval.compare's rule)
#   PRESET and anything run.sh reads (`bash run.sh --help`) apply to every run.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
: "${COMPARE_DIR:=exp/compare}" "${ALGORITHMS:=grpo grpo_no_std dapo rloo gspo}" "${SEEDS:=1 2}"
: "${STEPS:=20}" "${SAVE_FREQ:=5}" "${BUDGET_S:=}"
BASE=$COMPARE_DIR/base
start=$SECONDS
stop_server() { [[ ! -f $BASE/reward_server.pid ]] || { kill "$(cat "$BASE/reward_server.pid")" 2>/dev/null || true; rm -f "$BASE/reward_server.pid"; }; }
trap stop_server EXIT  # a run that fails leaves no server behind on the port
# install, start model, data, and the reward server of a plain variant's weighting (REWARD_WEIGHTS, else
# CER alone, whatever the preset's default), left running for every plain variant
EXP_DIR=$BASE REWARD_WEIGHTS=${REWARD_WEIGHTS:-cer} bash run.sh -2 1
port0=${REWARD_PORT:-8000}
weightings=()  # the reward weightings other than the base server's, each with its own server port
for variant in $ALGORITHMS; do
  w=${variant#*+}; [[ $w != "$variant" ]] || continue
  [[ " ${weightings[*]} " == *" $w "* ]] || weightings+=("$w")
done
for seed in $SEEDS; do
  for variant in $ALGORITHMS; do
    algo=${variant%%+*} weights=${REWARD_WEIGHTS:-cer} port=$port0
    if [[ $variant == *+* ]]; then
      weights=${variant#*+}
      for k in "${!weightings[@]}"; do [[ ${weightings[$k]} != "$weights" ]] || port=$(( port0 + k + 1 )); done
    fi
    run=$COMPARE_DIR/$variant-seed$seed
    if [[ -f $run/eval/summary.json ]]; then echo "== $run: scored already, kept"; continue; fi
    rm -rf "$run"  # a run that died half-way starts again (verl would resume it with another clock)
    echo "== $run ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$COMPARE_DIR/runs.log"
    EXP_DIR=$run HF_MODEL_DIR=$BASE/hf_model DATA_DIR=$BASE/data ALGORITHM=$algo SEED=$seed \
      REWARD_WEIGHTS=$weights REWARD_PORT=$port \
      GRPO_EXTRA="--total-training-steps $STEPS --save-freq $SAVE_FREQ" bash run.sh 2 4
    echo "   done $(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$COMPARE_DIR/runs.log"
  done
done
stop_server
.venv/bin/python -m ttsrl.eval.compare "$COMPARE_DIR" ${BUDGET_S:+--budget-s "$BUDGET_S"}
echo "compare_algorithms.sh: done in $(( SECONDS - start )) s"

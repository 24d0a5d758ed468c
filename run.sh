#!/usr/bin/env bash
# ttsrl: GRPO post-training of CosyVoice's speech-token LLMs (CosyVoice2, Fun-CosyVoice3), stage by stage.
#   bash run.sh [START [STOP]] [-- HYDRA_OVERRIDE...]   stages -2..5 (default: all) of PRESET
#   bash run.sh --config | --help                         the resolved settings | the contract
# Each stage below calls one CLI; the settings (preset, environment, what is derived from
# EXP_DIR and the node list), the reward servers and the roles of several nodes are
# ttsrl/launch/ (python -m ttsrl.launch).
# shellcheck disable=SC2153  # the settings come from the launcher (eval "$SETTINGS")
set -euo pipefail
shopt -s inherit_errexit 2>/dev/null || true
cd "$(dirname "$0")"
ROOT=$PWD PY=$PWD/.venv/bin/python
# a path's bytes that are not UTF-8 (EXP_DIR=$'x\xff') go out of every Python here as they came in
# (a locale or PYTHONIOENCODING=utf-8 with strict errors raised UnicodeEncodeError printing them)
PYTHONIOENCODING=${PYTHONIOENCODING:-}
export PYTHONIOENCODING="${PYTHONIOENCODING%%:*}:surrogateescape"
host_py() { if [[ -x $PY ]]; then echo "$PY"; else echo python3; fi; }  # python3 before stage -2 made the venv
launch() { "$(host_py)" -m ttsrl.launch "${RAY_ARGS[@]}" "$@"; }
RAY_ARGS=()
if [[ ${1:-} == -h || ${1:-} == --help ]]; then launch help; exit 0; fi

# ---- settings: the preset's values (each a default: the environment wins), resolved and checked
export PRESET=${PRESET:-presets/embedded.sh}
[[ -f $PRESET ]] || { echo "preset $PRESET not found" >&2; exit 2; }
: "${NODE_RANK:=${SLURM_NODEID:-0}}" "${LOGGERS:=console}"  # before the preset, which may read them
export NODE_RANK LOGGERS
ENV_NAMES=$(compgen -e | tr '\n' ' ')  # a list given here as a string is refused (the preset's array would win)
set +u -a  # what the preset leaves unset is named by the launcher, all at once; its values exported
# shellcheck source=presets/embedded.sh
source "$PRESET"
set -u +a
arrays() {  # every array the preset set, NUL-separated: NAME COUNT ITEM...
  local name
  for name in $(compgen -A arrayvar); do
    [[ $name =~ ^(BASH_|FUNCNAME$|GROUPS$|PIPESTATUS$|DIRSTACK$|COMP_|RAY_ARGS$) ]] && continue
    local -n list=$name
    printf '%s\0%s\0' "$name" "${#list[@]}"
    (( ${#list[@]} == 0 )) || printf '%s\0' "${list[@]}"
    unset -n list
  done
}
SETTINGS=$(launch settings --arrays <(arrays) --env-names "$ENV_NAMES" -- "$@") || exit $?
eval "$SETTINGS"  # export NAME=... for every setting, NAME=(...) for every list (ttsrl/launch/settings.py)
RAY_ARGS=("${RAY_START_ARGS[@]/#/--ray-arg=}")
export PYTHONUNBUFFERED=1

# one run.sh at a time on an EXP_DIR (each node its own lock): flock on fd 9. No child may hold it:
# the stages run in run_stages, called with fd 9 closed (bash keeps the lock on a close-on-exec copy),
# so a child left behind by a killed run.sh does not keep the next run out
mkdir -p "$(dirname "$LOCK_FILE")"
exec 9>> "$LOCK_FILE"
if ! command -v flock > /dev/null; then
  echo "     (no flock here: nothing keeps a second run.sh off $EXP_DIR)"
elif ! flock -n 9; then
  holder=$(cat "$LOCK_FILE" 2>/dev/null || echo '?')
  if [[ $holder =~ ^pid\ ([0-9]+), ]] && ! kill -0 "${BASH_REMATCH[1]}" 2>/dev/null; then
    echo "$LOCK_FILE is held, but the run.sh that took it is gone ($holder): a process it started still holds it" \
      "(fuser -v $(printf %q "$LOCK_FILE") names it); stop that process, or give this run another EXP_DIR" >&2
  else
    echo "another run.sh is running on $EXP_DIR: $holder; wait for it, or give this run another EXP_DIR" >&2
  fi
  exit 1
fi
printf 'pid %s, stages %s..%s, started %s on %s\n' "$$" "$START" "$STOP" "$(date '+%F %T')" "$(hostname)" > "$LOCK_FILE"

run_stages() {  # the rest of run.sh (at the end: run_stages 9>&-)

stage() { (( $1 >= START && $1 <= STOP )); }
is_head() { (( NODE_RANK == 0 )); }
LAST_STAGE="" STARTED_SERVER=0 HEAD_RUN=0
banner() {  # banner STAGE "what it does" "where its output goes"
  printf '\n==== stage %s [%s]: %s\n     -> %s\n' "$1" "$PRESET_NAME" "$2" "$3"
  [[ $1 == "$LAST_STAGE" ]] || STAGE_T0=$SECONDS
  LAST_STAGE=$1
}
done_stage() { printf '     stage %s done in %ss\n' "$1" $(( SECONDS - STAGE_T0 )); }
head_only() {  # true on the head (or on one node); on a worker, says the stage is skipped
  is_head && return 0
  banner "$1" "runs on the head (rank 0); this is rank $NODE_RANK ($NODE_IP): skipped" "-"
  return 1
}
need_venv() { [[ -x $PY ]] || { echo "no .venv: run stage -2 first (bash run.sh -2 -2)" >&2; exit 1; }; }
reward_servers() {  # this machine's server started (or adopted, or used) and every server checked
  local ours=()
  if (( STARTED_SERVER )); then ours=(--ours); fi
  local rc=0
  launch server up "${ours[@]}" -- "$PY" token2wav_asr_server.py --backend "$REWARD_BACKEND" \
    --reward "$REWARD" "${WEIGHT_ARGS[@]}" --port "$REWARD_PORT" --family "$MODEL_FAMILY" "${REWARD_ARGS[@]}" \
    || rc=$?
  # the pid file names the server this run stops, also when the check of the other servers failed
  [[ ! -f $SERVER_PID_FILE ]] || STARTED_SERVER=1
  return "$rc"
}
on_exit() {
  local rc=$1
  (( rc == 0 || ! HEAD_RUN )) || launch failed "$rc" "${LAST_STAGE:-?}" || true
  if (( STARTED_SERVER )); then  # a failed run stops it too: nothing would use it, nothing else stops it
    if (( STOP >= 2 || rc != 0 )); then launch server down
    else echo "     reward server left running (stop: kill \"\$(cat $(printf %q "$SERVER_PID_FILE"))\")"; fi
  fi
}
trap 'on_exit $?' EXIT
# presets with user-provided files (gpu8) check them all with one message: up front, or, when the run
# fetches them (FETCH_ARGS and stage -1 in range), right after the fetch at the start of stage -1
FETCHING=0
if [[ -n ${FETCH_ARGS+set} ]] && stage -1; then FETCHING=1; fi
check_inputs() { "$(host_py)" scripts/check_inputs.py "${CHECK_INPUTS_ARGS[@]}" || exit 1; }
if [[ -n ${CHECK_INPUTS_ARGS+set} ]] && (( STOP >= -1 && ! FETCHING )); then check_inputs; fi

# PROMPT_POOL=DIR: zero-shot, every row (dev rows and mined texts too) with a speaker prompt of DIR,
# chosen by stage 0's seeded rule (empty: text-only): the same flags for devsplit and prepare; mining
# takes each text's prompt from stage 0's training rows
POOL=() MINE_POOL=()
if [[ -n $PROMPT_POOL ]]; then
  POOL=(--prompt-pool "$PROMPT_POOL" --prompt-seed "$PROMPT_SEED")
  MINE_POOL=(--prompt-pool "$PROMPT_POOL" --prompt-rows "$DATA_DIR/train.parquet")
fi

if stage -2; then
  banner -2 "install Python packages" "$ROOT/.venv"
  mkdir -p "$LOG_DIR"
  echo "     installing (full output: $LOG_DIR/install.log)"
  seen=0  # earlier runs' lines stay in the log: show only this run's
  [[ -f $LOG_DIR/install.log ]] && seen=$(wc -l < "$LOG_DIR/install.log")
  GPU_FLAG=()
  if [[ $DEVICE == cuda ]]; then GPU_FLAG=(--gpu); fi
  if ! bash scripts/install.sh "${GPU_FLAG[@]}" >> "$LOG_DIR/install.log" 2>&1; then
    echo "stage -2 failed; the end of $LOG_DIR/install.log:" >&2; tail -40 "$LOG_DIR/install.log" >&2; exit 1
  fi
  tail -n +$(( seen + 1 )) "$LOG_DIR/install.log" | { grep '^\[install\]' || true; } | sed 's/^/     /'
  done_stage -2
fi

if stage -1 && (( FETCHING )); then  # every node: its reward server and stage 4 read the inputs
  need_venv
  banner -1 "fetch the inputs with a public source (python -m ttsrl.fetch), then check them all" "$(dirname "$COSYVOICE2_DIR"), data/"
  "$PY" -m ttsrl.fetch "${FETCH_ARGS[@]}" || exit 1
  if [[ -n ${CHECK_INPUTS_ARGS+set} ]]; then check_inputs; fi
  done_stage -1
fi

if stage -1 && head_only -1; then
  need_venv
  if [[ $BUILD_BASE_MODEL == 1 ]]; then
    banner -1 "build the tiny $MODEL_FAMILY-format base model (cached)" "$COSYVOICE2_DIR"
    "$PY" build_base_model.py --corpus "$TRAIN_FILE" --out "$COSYVOICE2_DIR" --family "$MODEL_FAMILY" \
      "${BASE_MODEL_ARGS[@]}"  # step 0 of stage 4
  fi
  banner -1 "convert llm.pt -> Hugging Face checkpoint" "$HF_MODEL_DIR"
  "$PY" pretrained_to_huggingface.py --pretrained-cosyvoice2-path "$COSYVOICE2_DIR" --save-path "$HF_MODEL_DIR" \
    --family "$MODEL_FAMILY" --llm "$LLM_FILE"
  done_stage -1
fi

if stage 0 && head_only 0; then
  need_venv
  banner 0 "JSONL texts -> verl Parquet" "$DATA_DIR/{train,test}.parquet"
  if [[ -z $DEV_FILE ]] && (( DEV_SIZE > 0 )); then
    "$PY" -m ttsrl.data.devsplit --train "$TRAIN_FILE" --size "$DEV_SIZE" --out-dir "$SPLIT_DIR" "${POOL[@]}" \
      | sed 's/^/     /'
  fi
  LEAK=() DEV=()  # ALLOW_LEAK=1: keep test (and DEV_FILE) texts that are training texts too
  if [[ $ALLOW_LEAK == 1 ]]; then LEAK=(--allow-leak); fi
  if [[ -n $DEV_FILE ]]; then DEV=(--dev-file "$DEV_FILE"); fi  # checked against the run's mode, pool and texts
  "$PY" prepare_data.py --train_file "$TRAIN_TEXTS" --test_file "$TEST_FILE" --local_dir "$DATA_DIR" \
    --tokenizer "$HF_MODEL_DIR" --max_prompt_length "$MAX_PROMPT_LENGTH" "${LEAK[@]}" "${POOL[@]}" "${DEV[@]}" \
    || { echo "stage 0 failed (above: each row and why). A prompt over the budget: MAX_PROMPT_LENGTH=N bash run.sh 0 0" \
              "(the preset's budget is $MAX_PROMPT_LENGTH tokens, counted with $HF_MODEL_DIR's tokenizer" \
              "${PROMPT_POOL:+and each pool prompt (transcript and speech tokens)}); a pool prompt none fits:" \
              "a larger MAX_PROMPT_LENGTH or shorter prompts;" \
              "test or DEV_FILE texts that are training texts too: remove them, or ALLOW_LEAK=1 to keep them;" \
              "DEV_FILE rows of another mode or pool prompt: fix the rows named above" >&2; exit 1; }
  done_stage 0
fi

if stage 1; then
  need_venv
  banner 1 "start the reward server ($REWARD_BACKEND backend, reward $REWARD)" "$REWARD_URL"
  reward_servers
  done_stage 1
fi

# Ray 2.60 keeps the cluster token in ~/.ray/auth_token and creates it readable by everyone (0644):
# the folder and the token are made this user's alone, before stage 2 and after (Ray may create it)
private_ray_dir() {
  mkdir -p "$HOME/.ray" && chmod 700 "$HOME/.ray"
  if [[ -f $HOME/.ray/auth_token ]]; then chmod 600 "$HOME/.ray/auth_token"; fi
}

if stage 2; then
  need_venv
  private_ray_dir
  if [[ $TRAINER == grpo ]] && ! is_head; then  # a worker lends its node to the head's Ray until training ends
    banner 2 "join the head's Ray cluster at $HEAD_IP:$RAY_PORT; returns when it stops" "$LOG_DIR/ray.log"
    launch join
  elif [[ $TRAINER == grpo ]]; then
    banner 2 "GRPO through verl.trainer.main_ppo" "$CKPT_DIR/global_step_N/actor"
    reward_servers
    (( NNODES == 1 )) || HEAD_RUN=1
    # verl's full output to the log, one line per step here (ttsrl/console.py); several nodes: in the head's Ray
    launch grpo -- "$PY" train_grpo.py "${GRPO_ARGS[@]}" -- "${EXTRA_OVERRIDES[@]}"
  else
    banner 2 "pair mining + ${TRAINER^^} (TRL)" "$PAIRS_FILE, $MERGED_DIR/step_N"
    mkdir -p "$LOG_DIR" "$(dirname "$PAIRS_FILE")"
    if [[ -n $USER_PAIRS ]]; then  # its own file (PAIRS_FILE), converted again on every run
      "$PY" mine_pairs.py --model "$HF_MODEL_DIR" --user-pairs "$USER_PAIRS" --out "$PAIRS_FILE" --force \
        || { echo "stage 2 failed: reading USER_PAIRS=$USER_PAIRS (the message above names the line)" >&2; exit 1; }
    elif [[ -f $PAIRS_FILE ]]; then
      echo "     reusing pairs $PAIRS_FILE (delete it to mine again)"
    else
      reward_servers
      [[ -f $TRAIN_TEXTS ]] || { echo "$TRAIN_TEXTS not found: run stage 0 first (it holds the dev set out)" >&2; exit 1; }
      [[ -z $PROMPT_POOL || -f $DATA_DIR/train.parquet ]] \
        || { echo "$DATA_DIR/train.parquet not found: run stage 0 first (it gives each text its prompt)" >&2; exit 1; }
      "$PY" mine_pairs.py --model "$HF_MODEL_DIR" --texts "$TRAIN_TEXTS" --out "$PAIRS_FILE" \
        --reward-url "$REWARD_URLS" "${MINE_POOL[@]}" "${MINE_ARGS[@]}" 2>&1 | tee -a "$LOG_DIR/mine_pairs.log" \
        || { echo "stage 2 failed: pair mining (log $LOG_DIR/mine_pairs.log)" >&2; exit 1; }
    fi
    "$PY" "${PREF_LAUNCH[@]}" train_dpo.py --model "$HF_MODEL_DIR" --pairs "$PAIRS_FILE" --out-dir "$MERGED_DIR" \
      --trainer "$TRAINER" "${PREF_ARGS[@]}" 2>&1 | tee -a "$LOG_DIR/train_$TRAINER.log" \
      || { echo "stage 2 failed: ${TRAINER^^} training (log $LOG_DIR/train_$TRAINER.log)" >&2; exit 1; }
  fi
  private_ray_dir  # a token Ray created during training
  done_stage 2
fi

if stage 3 && [[ $TRAINER != grpo ]]; then
  banner 3 "nothing to merge: ${TRAINER^^} writes merged checkpoints" "$MERGED_DIR/step_N"
elif stage 3 && is_head; then
  need_venv
  banner 3 "merge FSDP shards of every saved step" "$MERGED_DIR/step_N"
  (( NNODES == 1 )) || HEAD_RUN=1
  "$PY" merge_checkpoints.py --ckpt-dir "$CKPT_DIR" --out-dir "$MERGED_DIR" --base-model "$HF_MODEL_DIR"
  (( NNODES == 1 )) || launch mark merged
  done_stage 3
elif stage 3; then
  need_venv
  banner 3 "the head merges; this node waits for its marker" "$NODES_DIR/merged"
  launch await merged "every saved step merged"
  done_stage 3
fi

if stage 4; then
  need_venv
  banner 4 "synthesise the dev and test sets with every model and score CER (reward $REWARD)" "$EVAL_DIR/{report.md,summary.json,terms.png}"
  ARGS=(--reward "$REWARD")
  if [[ -n $DEV_SET ]]; then
    [[ -f $DEV_SET ]] || { echo "dev set $DEV_SET not found: run stage 0 first (it holds the dev set out)" >&2; exit 1; }
    ARGS+=(--dev-set "dev=$DEV_SET")
  fi
  # several nodes: each scores its share of the models (EVAL_DIR shared); node 0 waits for the
  # other shares' markers, scores what is left and writes the report
  if (( NNODES > 1 )); then ARGS+=(--node-share "$NODE_RANK/$NNODES"); fi
  if (( NNODES > 1 )) && is_head; then ARGS+=(--wait-shares "$SHARE_WAIT_S"); fi
  # ttsrl.lifeline: torchrun (and, through infer_dataset.py, its ranks) dies with this script
  "$PY" -m ttsrl.lifeline "$PY" -m torch.distributed.run --standalone --nproc_per_node "$EVAL_NPROC" infer_dataset.py \
    --start-model "$HF_MODEL_DIR" --merged-dir "$MERGED_DIR" --out-dir "$EVAL_DIR" --family "$MODEL_FAMILY" \
    "${ARGS[@]}" "${EVAL_ARGS[@]}"
  done_stage 4
fi

if stage 5 && head_only 5; then
  need_venv
  banner 5 "export the step chosen on the dev set (or EXPORT_STEP) to $MODEL_FAMILY's llm.pt" "$EXPORT_PATH"
  "$PY" huggingface_to_pretrained.py --from-sweep "$EVAL_DIR/summary.json" --merged-dir "$MERGED_DIR" \
    --start-model "$HF_MODEL_DIR" ${EXPORT_STEP:+--step "$EXPORT_STEP"} --output-path "$EXPORT_PATH" \
    --family "$MODEL_FAMILY" --verify
  done_stage 5
fi
}
run_stages 9>&-

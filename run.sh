#!/usr/bin/env bash
# ttsrl: GRPO post-training of CosyVoice2's speech-token LLM, stage by stage.
#
#   bash run.sh                      all stages (-2 .. 5) of the embedded CPU preset
#   bash run.sh START STOP           a contiguous range of stages, e.g. `bash run.sh 1 3`
#   bash run.sh 2 2 -- KEY=VALUE...  extra Hydra overrides for verl's main_ppo (stage 2)
#   bash run.sh --config             print the settings a run would use (after the rules below), run nothing
#   PRESET=presets/gpu8.sh bash run.sh -1 5     the 8-GPU recipe
#   TRAINER=dpo bash run.sh          offline DPO (or TRAINER=kto) instead of GRPO: stage 2 mines
#                                    pairs and trains on TRL; outputs under EXP_DIR/dpo/ (see below)
#
# Stages: -2 install .venv | -1 build (embedded) + convert llm.pt -> HF | 0 JSONL -> Parquet
#          1 reward server | 2 GRPO (verl) | 3 merge FSDP checkpoints | 4 CER sweep
#          5 export the step chosen on the dev set (or EXPORT_STEP) to llm.pt
#   Dev set: DEV_FILE=dev.jsonl, or (default) DEV_SIZE training texts held out of training
#   by stage 0; stage 5 chooses on it, never on a test set. DEV_SIZE=0 and no DEV_FILE:
#   no dev set, and stage 5 needs EXPORT_STEP.
#
# Settings: the preset (PRESET, default presets/embedded.sh) sets what differs between runs;
#   run.sh derives the rest from EXP_DIR. One rule for every preset: a setting given in the
#   environment wins. Presets write each value as a default, `: "${VAR:=value}"`, and so does
#   run.sh for what it derives: `EXP_DIR=/data/run1 DEV_SIZE=100 bash run.sh` moves every output
#   folder and resizes the dev set, in either preset. Argument lists are bash arrays (a path with
#   a space stays one argument); the environment cannot carry an array, so a list changes in a
#   preset of your own (copy one), except REWARD_EXTRA="--flag 'a value'": words added to
#   REWARD_ARGS, split as the shell splits words (quotes keep a space inside one argument).
#   run.sh derives, when neither the environment nor the preset sets them: HF_MODEL_DIR DATA_DIR
#   CKPT_DIR MERGED_DIR EVAL_DIR EXPORT_PATH TENSORBOARD_DIR under EXP_DIR (TRAINER=dpo|kto:
#   MERGED_DIR and EVAL_DIR under EXP_DIR/$TRAINER, EXPORT_PATH EXP_DIR/llm-$TRAINER.pt),
#   PRESET_NAME (the preset's file name), LOGGERS REWARD_PORT BUILD_BASE_MODEL DEV_SIZE DEV_FILE,
#   and for TRAINER=dpo|kto MINE_ARGS PREF_ARGS PREF_LAUNCH PAIRS_FILE USER_PAIRS.
#   Named variants (a preset's default, the environment wins): REWARD (stage 1's reward, REWARDS in
#   ttsrl/reward/rewards.py: tanh, toneless, exp_toneless, tanh_reference, cer_nll; default tanh),
#   ALGORITHM (stage 2's estimator and loss, ttsrl/train/algorithms.py: grpo, grpo_no_std, dapo, rloo,
#   gspo, gdpo; default grpo), SAMPLING (stage 2's rollout sampling there: reference or mairhub; empty: the
#   preset's own), SEED (stage 2's prompt order and rollout sampling seed; empty: verl's defaults).
#   The later NVIDIA mair-hub recipe: REWARD=exp_toneless SAMPLING=mairhub.
#
# Several nodes (GRPO): the same command on every node (srun, pdsh, or one shell per node), e.g.
#   NODE_IPS=10.0.0.1,10.0.0.2 NODE_RANK=R EXP_DIR=/shared/run1 bash run.sh -2 5
#   NODE_IPS     node IPs (or host names), comma-separated, head first (default: slurm's
#                `scontrol show hostnames $SLURM_JOB_NODELIST`; empty: one node, as before)
#   NODE_RANK    this node's index in NODE_IPS (default: $SLURM_NODEID, else 0); NNODES, HEAD_IP
#                and NODE_IP follow from the two. EXP_DIR (and every folder under it) must be an
#                absolute path on a filesystem every node mounts at the same place.
#   The head (rank 0) runs stages -1 and 0; stage 2 starts a Ray head (unless RAY_ADDRESS answers:
#   that cluster is used), waits until every node joined with GPUS_PER_NODE GPUs (naming the
#   missing ones after JOIN_TIMEOUT_S=600 s), trains, stops its Ray; stage 3 merges and marks
#   EXP_DIR/nodes/merged; stage 5 exports. A worker's stage 2 joins the head's Ray and returns when
#   it stops; its stage 3 waits for the head's marker of the run it joined (HEAD_WAIT_S, 0: no
#   limit); stage 4 scores its share of the checkpoints on every node. Every node serves rewards
#   at http://NODE_IP:REWARD_PORT when REWARD_URLS lists that URL. Logs: EXP_DIR/logs/nodeR/.
#   REWARD_START_TIMEOUT_S: how long stage 1 (and 2, when it starts the server) waits for reward
#   servers to answer ready (run.sh's default 300 s; presets/gpu8.sh: 900 s, 8 replicas loading).
#   Ray settings: RAY_PORT (6379, the head's GCS), RAY_NODE_PORT (RAY_PORT+1: each node's 10
#   fixed ports from there), RAY_WORKER_PORTS (10002-19999), RAY_TEMP_DIR (Ray's default),
#   RAY_NUM_CPUS (16 logical CPUs a node on DEVICE=cpu, with GPUS_PER_NODE=1 logical GPU),
#   RAY_START_ARGS (a preset's array of more `ray start` arguments), RAY_START_ATTEMPTS (3: a node
#   whose Ray fails to start is started again). Ranks on one host (the
#   same or loopback IPs) split these ports. Ray's token authentication is on
#   (RAY_AUTH_MODE=token): every node needs the head's ~/.ray/auth_token.
#   A rehearsal on one machine: presets/multinode_sim.sh (its top says how).
set -euo pipefail
shopt -s inherit_errexit 2>/dev/null || true
cd "$(dirname "$0")"
ROOT=$PWD

STAGES=(-2 -1 0 1 2 3 4 5)   # a new stage: add its number here and an `if stage N` block below
# what every preset must set (one value each, then the argument lists)
REQUIRED=(DEVICE EXP_DIR COSYVOICE2_DIR TRAIN_FILE TEST_FILE MAX_PROMPT_LENGTH REWARD_BACKEND EVAL_NPROC)
REQUIRED_ARRAYS=(REWARD_ARGS GRPO_ARGS EVAL_ARGS)
usage() {
  echo "usage: bash run.sh [START [STOP]] [-- HYDRA_OVERRIDE...] | --config   (stages ${STAGES[*]}; bash run.sh --help)" >&2
  exit 2
}
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  printf '  A preset must set %s\n  and the arrays %s.\n' "${REQUIRED[*]}" "${REQUIRED_ARRAYS[*]}"
  exit 0
fi
SHOW_CONFIG=0
if [[ ${1:-} == --config ]]; then
  (( $# == 1 )) || { echo "run.sh: --config takes no other argument (got: ${*:2})" >&2; usage; }
  SHOW_CONFIG=1; shift
fi
is_stage() { local s; for s in "${STAGES[@]}"; do [[ $1 == "$s" ]] && return 0; done; return 1; }
POSITIONAL=()
while (( $# )) && [[ $1 != -- ]]; do POSITIONAL+=("$1"); shift; done
EXTRA_OVERRIDES=()
if (( $# )); then shift; EXTRA_OVERRIDES=("$@"); fi
if (( ${#POSITIONAL[@]} > 2 )); then
  echo "run.sh: unexpected argument '${POSITIONAL[2]}' (Hydra overrides for stage 2 go after '--')" >&2; usage
fi
START=${POSITIONAL[0]:-${STAGES[0]}}
STOP=${POSITIONAL[1]:-${STAGES[-1]}}
for s in "$START" "$STOP"; do
  is_stage "$s" || { echo "run.sh: stage '$s' is not one of: ${STAGES[*]}" >&2; usage; }
done
(( START <= STOP )) || { echo "run.sh: START ($START) is after STOP ($STOP)" >&2; usage; }
if (( ${#EXTRA_OVERRIDES[@]} )) && ! (( START <= 2 && 2 <= STOP )); then
  echo "run.sh: overrides after '--' are for stage 2, which is not in $START..$STOP" >&2; usage
fi

# ---- settings: the environment, else the preset, else run.sh's default (see --help) ----------
TRAINER=${TRAINER:-grpo}
PRESET=${PRESET:-presets/embedded.sh}
[[ -f $PRESET ]] || { echo "preset $PRESET not found" >&2; exit 2; }
: "${NODE_RANK:=${SLURM_NODEID:-0}}"  # before the preset, which may derive ports from it
: "${LOGGERS:=console}"  # console[,tensorboard][,wandb]; before the preset, whose GRPO_ARGS reads it
# without `set -u` while the preset runs: what it leaves unset is named by check_preset below,
# all at once, instead of bash stopping at the first "unbound variable"
set +u
# shellcheck source=presets/embedded.sh
source "$PRESET"
set -u
# what a preset-less dpo/kto run uses; the presets set their own
declare -p MINE_ARGS &>/dev/null || MINE_ARGS=(--k 4 --min-margin 0.1)
declare -p PREF_ARGS &>/dev/null || PREF_ARGS=(--lr 1e-5 --batch-size 8 --epochs 1)
declare -p PREF_LAUNCH &>/dev/null || PREF_LAUNCH=()  # e.g. (-m accelerate.commands.launch --num_processes 8 ...)
# check_preset: every required setting the preset leaves unset, and every list that is not an
# array (a string would split a path with a space), in one message
check_preset() {
  local v problems=() missing=()
  for v in "${REQUIRED[@]}"; do [[ -n ${!v:-} ]] || missing+=("$v"); done
  for v in "${REQUIRED_ARRAYS[@]}"; do declare -p "$v" &>/dev/null || missing+=("$v"); done
  if (( ${#missing[@]} )); then
    problems+=("it does not set ${missing[*]} (every preset sets ${REQUIRED[*]} and the arrays ${REQUIRED_ARRAYS[*]}; a value may also come from the environment)")
  fi
  for v in "${REQUIRED_ARRAYS[@]}" MINE_ARGS PREF_ARGS PREF_LAUNCH CHECK_INPUTS_ARGS; do
    if declare -p "$v" &>/dev/null && [[ $(declare -p "$v") != "declare -a"* ]]; then
      problems+=("$v must be a bash array, e.g. $v=(--flag \"a value\")")
    fi
  done
  (( ${#problems[@]} )) || return 0
  for v in "${problems[@]}"; do echo "$PRESET: $v"; done >&2
  exit 2
}
check_preset
: "${REWARD:=tanh}" "${ALGORITHM:=grpo}" "${SAMPLING:=}" "${SEED:=}"  # the named variants (see --help)
# run.sh's defaults, derived from EXP_DIR where they are paths
: "${PRESET_NAME:=$(basename "$PRESET" .sh)}"
: "${HF_MODEL_DIR:=$EXP_DIR/hf_model}" "${DATA_DIR:=$EXP_DIR/data}" "${CKPT_DIR:=$EXP_DIR/checkpoints}"
: "${REWARD_PORT:=8000}" "${REWARD_START_TIMEOUT_S:=300}" "${BUILD_BASE_MODEL:=0}" "${DEV_FILE:=}" "${DEV_SIZE:=0}" "${USER_PAIRS:=}"
[[ $EXP_DIR == /* ]] && EXP_ABS=$EXP_DIR || EXP_ABS=$ROOT/$EXP_DIR
: "${TENSORBOARD_DIR:=$EXP_ABS/tensorboard}"  # used when LOGGERS has tensorboard
# Offline preference optimisation (TRAINER=dpo|kto): stage 2 becomes "mine pairs (mine_pairs.py)
# + train (train_dpo.py)"; the trainer writes HF checkpoints in the merged layout, so stage 3 has
# nothing to merge and stages 4/5 read MERGED_DIR. Its own folders keep GRPO's results intact.
case $TRAINER in
  grpo) : "${MERGED_DIR:=$EXP_DIR/merged}" "${EVAL_DIR:=$EXP_DIR/eval}" "${EXPORT_PATH:=$EXP_DIR/llm-new.pt}" ;;
  dpo|kto)
    : "${MERGED_DIR:=$EXP_DIR/$TRAINER/merged}" "${EVAL_DIR:=$EXP_DIR/$TRAINER/eval}"
    : "${EXPORT_PATH:=$EXP_DIR/llm-$TRAINER.pt}"
    # USER_PAIRS: a JSONL of your own pairs instead of mining, converted into its own file (so
    # it never replaces mined pairs, which dpo and kto share); checked before any stage runs
    if [[ -z $USER_PAIRS ]]; then
      : "${PAIRS_FILE:=$EXP_DIR/pairs/pairs.parquet}"
    else
      : "${PAIRS_FILE:=$EXP_DIR/pairs/user-pairs.parquet}"
      if (( START <= 2 && 2 <= STOP )) && ! [[ -f $USER_PAIRS && -r $USER_PAIRS ]]; then
        echo "USER_PAIRS=$USER_PAIRS: no such readable file (expected a JSONL of pairs, one {\"text\", \"chosen\", \"rejected\"} a line)" >&2
        exit 2
      fi
    fi ;;
  *) echo "TRAINER must be grpo, dpo or kto (got $TRAINER): grpo trains online with verl," \
       "dpo and kto offline with TRL on mined pairs" >&2; exit 2 ;;
esac
PY=$ROOT/.venv/bin/python
if [[ -x $PY ]]; then HOST_PY=$PY; else HOST_PY=python3; fi  # before stage -2 made the venv
# words NAME STRING WHAT: NAME=(STRING's words, split and unquoted as the shell does; nothing in
# it runs); a STRING the shell could not split (an open quote) stops run.sh with a message on WHAT
words() {
  local -n _words=$1
  local out
  out=$("$HOST_PY" -c 'import shlex, sys
w = shlex.split(sys.argv[1])
assert not any("\n" in x for x in w), "a word with a line break"
print("\n".join(w), end="")' "$2" 2>&1) || {
    echo "$3 ($2): not words as the shell splits them ($(tail -1 <<<"$out")); quote a value with a space, e.g. --flag 'a value'" >&2
    exit 2
  }
  _words=()
  [[ -z $out ]] || mapfile -t _words <<<"$out"
}
# REWARD_EXTRA: reward-server arguments added to the preset's REWARD_ARGS; an array in a preset,
# or a string in the environment, e.g. the reference-exact reward of presets/gpu8.sh:
# REWARD_EXTRA="--no-length-guard --reward tanh_reference"
if [[ $(declare -p REWARD_EXTRA 2>/dev/null) == "declare -a"* ]]; then
  REWARD_ARGS+=("${REWARD_EXTRA[@]}")
elif [[ -n ${REWARD_EXTRA:-} ]]; then
  words REWARD_EXTRA_WORDS "$REWARD_EXTRA" REWARD_EXTRA
  REWARD_ARGS+=("${REWARD_EXTRA_WORDS[@]}")
fi
# dev set: stage 5 chooses the step on it (never on a test set)
SPLIT_DIR=$DATA_DIR/split
if [[ -n $DEV_FILE ]]; then
  DEV_SET=$DEV_FILE TRAIN_TEXTS=$TRAIN_FILE
elif (( DEV_SIZE > 0 )); then  # stage 0 holds DEV_SIZE training texts out (ttsrl/data/devsplit.py)
  DEV_SET=$SPLIT_DIR/dev.jsonl TRAIN_TEXTS=$SPLIT_DIR/train.jsonl
else
  DEV_SET='' TRAIN_TEXTS=$TRAIN_FILE
fi
# nodes: NODE_IPS NNODES HEAD_IP NODE_IP and the Ray settings, checked (scripts/nodes.sh)
# shellcheck source=scripts/nodes.sh
source "$ROOT/scripts/nodes.sh"
node_settings
REWARD_URL=http://127.0.0.1:$REWARD_PORT   # the server stage 1 starts on this machine
if multi_node; then  # other nodes reach it at this node's address
  REWARD_URL=http://$NODE_IP:$REWARD_PORT
  REWARD_ARGS+=(--host "$NODE_IP")
fi
# REWARD_URLS: every reward server the training and mining clients use, comma-separated (default:
# this machine's); the client spreads requests over them and fails over (ttsrl/reward/pool.py).
# Stage 1 starts a local server only when REWARD_URL is in the list; REWARD_MIN_READY=N waits
# for N of them instead of all.
REWARD_URLS=${REWARD_URLS:-$REWARD_URL}
REWARD_MIN_READY=${REWARD_MIN_READY:-}
# print_config: every setting of this run, one a line, quoted as the shell would read it back
print_config() {
  local v quoted
  for v in PRESET PRESET_NAME TRAINER DEVICE EXP_DIR BUILD_BASE_MODEL COSYVOICE2_DIR HF_MODEL_DIR TRAIN_FILE TEST_FILE \
           DATA_DIR DEV_FILE DEV_SIZE DEV_SET TRAIN_TEXTS MAX_PROMPT_LENGTH REWARD_BACKEND REWARD ALGORITHM SAMPLING SEED REWARD_PORT REWARD_START_TIMEOUT_S LOGGERS \
           REWARD_URLS REWARD_MIN_READY TENSORBOARD_DIR CKPT_DIR MERGED_DIR EVAL_DIR EVAL_NPROC EXPORT_PATH EXPORT_STEP USER_PAIRS PAIRS_FILE \
           NODE_IPS NODE_RANK NNODES HEAD_IP NODE_IP GPUS_PER_NODE RAY_PORT RAY_NODE_PORT RAY_WORKER_PORTS RAY_TEMP_DIR \
           RAY_NUM_CPUS JOIN_TIMEOUT_S HEAD_WAIT_S RAY_START_ATTEMPTS; do
    [[ -z ${!v+set} ]] || printf '%s=%q\n' "$v" "${!v}"
  done
  for v in REWARD_ARGS GRPO_ARGS EVAL_ARGS MINE_ARGS PREF_ARGS PREF_LAUNCH CHECK_INPUTS_ARGS RAY_START_ARGS; do
    declare -p "$v" &>/dev/null || continue
    local -n list=$v
    quoted=''
    (( ${#list[@]} == 0 )) || quoted=$(printf '%q ' "${list[@]}")
    printf '%s=(%s)\n' "$v" "${quoted% }"
    unset -n list
  done
}
if (( SHOW_CONFIG )); then print_config; exit 0; fi
LOG_DIR=$EXP_DIR/logs
SERVER_PID_FILE=$EXP_DIR/reward_server.pid
if multi_node; then  # nodes share EXP_DIR: each its own logs and server pid file
  LOG_DIR=$EXP_DIR/logs/node$NODE_RANK
  SERVER_PID_FILE=$NODES_DIR/reward_server.$NODE_RANK.pid
  export RAY_AUTH_MODE=token  # as `ray start --head` sets it up; the driver and nodes.py need it too
fi
# one run.sh at a time on an EXP_DIR (on each node of a multi-node run): a second is refused,
# naming the first. flock on fd 9, which the long-lived children started here do not keep (9>&-)
LOCK_FILE=$EXP_DIR/run.lock
multi_node && LOCK_FILE=$NODES_DIR/run.$NODE_RANK.lock
mkdir -p "$(dirname "$LOCK_FILE")"
exec 9>> "$LOCK_FILE"
if ! command -v flock > /dev/null; then
  echo "     (no flock here: nothing keeps a second run.sh off $EXP_DIR)"
elif ! flock -n 9; then
  echo "another run.sh is running on $EXP_DIR: $(cat "$LOCK_FILE" 2>/dev/null || echo '?'); wait for it, or give this run another EXP_DIR" >&2
  exit 1
fi
printf 'pid %s, stages %s..%s, started %s on %s\n' "$$" "$START" "$STOP" "$(date '+%F %T')" "$(hostname)" > "$LOCK_FILE"
export TTSRL_REWARD_URL=$REWARD_URLS TENSORBOARD_DIR
export PYTHONUNBUFFERED=1
STARTED_SERVER=0

stage() { (( $1 >= START && $1 <= STOP )); }
LAST_STAGE=
banner() {  # banner STAGE "what it does" "where its output goes"
  printf '\n==== stage %s [%s]: %s\n     -> %s\n' "$1" "$PRESET_NAME" "$2" "$3"
  [[ $1 == "$LAST_STAGE" ]] || STAGE_T0=$SECONDS
  LAST_STAGE=$1
}
done_stage() { printf '     stage %s done in %ss\n' "$1" $(( SECONDS - STAGE_T0 )); }
need_venv() { [[ -x $PY ]] || { echo "no .venv: run stage -2 first (bash run.sh -2 -2)" >&2; exit 1; }; }
# presets with user-provided files (gpu8) check them all up front, with one message; with the
# venv's Python (soundfile: the backend's own wav check) once it exists
if [[ -n ${CHECK_INPUTS_ARGS+set} ]] && (( STOP >= -1 )); then
  "$HOST_PY" scripts/check_inputs.py "${CHECK_INPUTS_ARGS[@]}" || exit 1
fi

server_ready() { "$PY" -m ttsrl.reward.health "$REWARD_URL" >/dev/null 2>&1; }
# serves_this_run [--expect pid=P]: the server at REWARD_URL serves this run's REWARD and REWARD_BACKEND
# (and is process P); else the message naming what it serves is on stderr
serves_this_run() {
  "$PY" -m ttsrl.reward.health "$REWARD_URL" --expect "reward=$REWARD" --expect "backend=$REWARD_BACKEND" "$@" >/dev/null
}
# is_our_server PID: that process is a reward server (a pid file can outlive its process, and the
# pid be reused by another)
is_our_server() { [[ $1 =~ ^[0-9]+$ ]] && ps -o args= -p "$1" 2>/dev/null | grep -q 'token2wav_asr_server\.py'; }
wait_for_servers() {  # every server of REWARD_URLS (or REWARD_MIN_READY of them) answers ready
  "$PY" -m ttsrl.reward.health "$REWARD_URLS" --wait "$REWARD_START_TIMEOUT_S" ${REWARD_MIN_READY:+--at-least "$REWARD_MIN_READY"}
}
start_local_server() {  # this machine's server at REWARD_URL: started, adopted or used
  if server_ready; then
    serves_this_run || { echo "stage ${LAST_STAGE:-1} stopped: this run asks for reward $REWARD and backend $REWARD_BACKEND;" \
      "stop that server, or set REWARD/REWARD_BACKEND (or REWARD_PORT) to match" >&2; exit 1; }
    if (( STARTED_SERVER )); then
      echo "     reward server of stage 1 answering at $REWARD_URL"
    elif [[ -f $SERVER_PID_FILE ]] && is_our_server "$(cat "$SERVER_PID_FILE")" \
        && serves_this_run --expect "pid=$(cat "$SERVER_PID_FILE")" 2>/dev/null; then
      # the server a crashed run.sh started (the pid file's process answers there) is adopted and stopped at the end
      STARTED_SERVER=1
      echo "     reward server already answering at $REWARD_URL (pid $(cat "$SERVER_PID_FILE"), started by an earlier run; stopped at the end)"
    else
      rm -f "$SERVER_PID_FILE"  # stale: its process is gone or another, or not the one answering
      echo "     reward server already answering at $REWARD_URL (not started by run.sh: used, and left running)"
    fi
    return 0
  fi
  rm -f "$SERVER_PID_FILE"
  mkdir -p "$LOG_DIR" "$(dirname "$SERVER_PID_FILE")"
  setsid nohup "$PY" token2wav_asr_server.py --backend "$REWARD_BACKEND" --reward "$REWARD" --port "$REWARD_PORT" "${REWARD_ARGS[@]}" \
    > "$LOG_DIR/reward_server.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$SERVER_PID_FILE"
  STARTED_SERVER=1
  "$PY" -m ttsrl.reward.health "$REWARD_URL" --wait "$REWARD_START_TIMEOUT_S" --pid "$(cat "$SERVER_PID_FILE")" \
    || { echo "reward server did not come up (waited up to ${REWARD_START_TIMEOUT_S}s: REWARD_START_TIMEOUT_S); see $LOG_DIR/reward_server.log" >&2; tail -20 "$LOG_DIR/reward_server.log" >&2; exit 1; }
  echo "     reward server pid $(cat "$SERVER_PID_FILE") at $REWARD_URL (log $LOG_DIR/reward_server.log)"
}
start_server() {  # the local server when REWARD_URLS lists it, then every listed server ready
  if [[ ,$REWARD_URLS, == *,"$REWARD_URL",* ]]; then
    start_local_server
    [[ $REWARD_URLS == "$REWARD_URL" ]] && return 0
  fi
  wait_for_servers || { echo "reward servers $REWARD_URLS are not ready (message above)" >&2; exit 1; }
  [[ ,$REWARD_URLS, == *,"$REWARD_URL",* ]] || echo "     reward servers answering at $REWARD_URLS (not started here)"
}
stop_server() {
  [[ -f $SERVER_PID_FILE ]] || return 0
  if is_our_server "$(cat "$SERVER_PID_FILE")"; then kill "$(cat "$SERVER_PID_FILE")" 2>/dev/null || true; fi
  rm -f "$SERVER_PID_FILE"
  echo "     reward server stopped"
}
on_exit() {
  local rc=$1
  (( rc == 0 )) || head_failed "$rc"
  stop_ray
  if (( STARTED_SERVER )); then
    if (( STOP >= 2 )); then stop_server; else echo "     reward server left running (stop: kill \$(cat $SERVER_PID_FILE))"; fi
  fi
}
trap 'on_exit $?' EXIT

if stage -2; then
  banner -2 "install Python packages" "$ROOT/.venv"
  INSTALL_ARGS=()
  [[ $DEVICE == cuda ]] && INSTALL_ARGS=(--gpu)
  # pip's own output (minutes of it) goes to the log; the console gets the installer's verdict
  mkdir -p "$LOG_DIR"
  echo "     installing (full output: $LOG_DIR/install.log)"
  seen=0  # earlier runs' lines stay in the log: show only this run's
  [[ -f $LOG_DIR/install.log ]] && seen=$(wc -l < "$LOG_DIR/install.log")
  if ! bash scripts/install.sh "${INSTALL_ARGS[@]}" >> "$LOG_DIR/install.log" 2>&1; then
    echo "stage -2 failed; the end of $LOG_DIR/install.log:" >&2
    tail -40 "$LOG_DIR/install.log" >&2
    exit 1
  fi
  tail -n +$(( seen + 1 )) "$LOG_DIR/install.log" | { grep '^\[install\]' || true; } | sed 's/^/     /'
  done_stage -2
fi

if stage -1 && head_only -1; then
  need_venv
  if [[ ${BUILD_BASE_MODEL:-0} == 1 ]]; then
    banner -1 "build the tiny CosyVoice2-format base model (cached)" "$COSYVOICE2_DIR"
    "$PY" build_base_model.py --corpus "$TRAIN_FILE" --out "$COSYVOICE2_DIR"  # stage 4 scores it (step 0)
  fi
  banner -1 "convert llm.pt -> Hugging Face checkpoint" "$HF_MODEL_DIR"
  "$PY" pretrained_to_huggingface.py --pretrained-cosyvoice2-path "$COSYVOICE2_DIR" --save-path "$HF_MODEL_DIR"
  done_stage -1
fi

if stage 0 && head_only 0; then
  need_venv
  banner 0 "JSONL texts -> verl Parquet" "$DATA_DIR/{train,test}.parquet"
  if [[ -z $DEV_FILE ]] && (( DEV_SIZE > 0 )); then
    "$PY" -m ttsrl.data.devsplit --train "$TRAIN_FILE" --size "$DEV_SIZE" --out-dir "$SPLIT_DIR" | sed 's/^/     /'
  fi
  LEAK_ARGS=()
  [[ ${ALLOW_LEAK:-0} == 1 ]] && LEAK_ARGS=(--allow-leak)  # keep test texts that are training texts too
  "$PY" prepare_data.py --train_file "$TRAIN_TEXTS" --test_file "$TEST_FILE" --local_dir "$DATA_DIR" \
    --tokenizer "$HF_MODEL_DIR" --max_prompt_length "$MAX_PROMPT_LENGTH" "${LEAK_ARGS[@]}" \
    || { echo "stage 0 failed (above: each row and why). A prompt over the budget: MAX_PROMPT_LENGTH=N bash run.sh 0 0" \
              "(the preset's budget is $MAX_PROMPT_LENGTH tokens, counted with $HF_MODEL_DIR's tokenizer);" \
              "test texts that are training texts too: remove them, or ALLOW_LEAK=1 to keep them" >&2; exit 1; }
  done_stage 0
fi

if stage 1; then
  need_venv
  banner 1 "start the reward server ($REWARD_BACKEND backend)" "$REWARD_URL"
  start_server
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
  case $TRAINER in
    grpo)
      if ! is_head; then  # a worker lends its node to the head's Ray until training ends
        banner 2 "join the head's Ray cluster at $HEAD_IP:$RAY_PORT; returns when it stops" "$LOG_DIR/ray.log"
        worker_ray
      else
        banner 2 "GRPO through verl.trainer.main_ppo" "$CKPT_DIR/global_step_N/actor"
        start_server  # reuses one that answers already
        mkdir -p "$LOG_DIR"
        CLUSTER_ARGS=()
        if multi_node; then  # Ray over NNODES nodes (scripts/nodes.sh), attached to by verl
          head_ray
          CLUSTER_ARGS=(--ray-address "$RAY_AT" --nnodes "$NNODES" --n-gpus-per-node "$GPUS_PER_NODE")
        fi
        # verl's full output (every metric of every step, Ray worker logs) is appended to the log;
        # the console gets the exact verl command and one line per step (ttsrl/console.py)
        if ! "$PY" train_grpo.py "${GRPO_ARGS[@]}" --algorithm "$ALGORITHM" ${SAMPLING:+--sampling "$SAMPLING"} ${SEED:+--seed "$SEED"} --model-path "$HF_MODEL_DIR" --train-files "$DATA_DIR/train.parquet" \
            --val-files "$DATA_DIR/test.parquet" --checkpoint-dir "$CKPT_DIR" --max-prompt-length "$MAX_PROMPT_LENGTH" \
            "${CLUSTER_ARGS[@]}" -- "${EXTRA_OVERRIDES[@]}" 2>&1 | "$PY" -m ttsrl.console --log "$LOG_DIR/train_grpo.log"; then
          why=$("$PY" -m ttsrl.console --why "$LOG_DIR/train_grpo.log" 2>/dev/null || true)
          [[ -z $why ]] || printf 'stage 2 failed; why, as its log says it:\n%s\n' "$why" >&2
          echo "stage 2 failed; the end of $LOG_DIR/train_grpo.log:" >&2
          tail -40 "$LOG_DIR/train_grpo.log" >&2
          exit 1
        fi
        if multi_node; then head_mark trained; stop_ray; fi
      fi ;;
    dpo|kto)
      banner 2 "pair mining + ${TRAINER^^} (TRL)" "$PAIRS_FILE, $MERGED_DIR/step_N"
      mkdir -p "$LOG_DIR" "$(dirname "$PAIRS_FILE")"
      if [[ -n $USER_PAIRS ]]; then  # its own file (PAIRS_FILE above), converted again on every run
        "$PY" mine_pairs.py --model "$HF_MODEL_DIR" --user-pairs "$USER_PAIRS" --out "$PAIRS_FILE" --force \
          || { echo "stage 2 failed: reading USER_PAIRS=$USER_PAIRS (the message above names the line)" >&2; exit 1; }
      elif [[ -f $PAIRS_FILE ]]; then
        echo "     reusing pairs $PAIRS_FILE (delete it to mine again)"
      else
        start_server  # reuses one that answers already
        [[ -f $TRAIN_TEXTS ]] || { echo "$TRAIN_TEXTS not found: run stage 0 first (it holds the dev set out)" >&2; exit 1; }
        "$PY" mine_pairs.py --model "$HF_MODEL_DIR" --texts "$TRAIN_TEXTS" --out "$PAIRS_FILE" \
          --reward-url "$REWARD_URLS" "${MINE_ARGS[@]}" 2>&1 | tee -a "$LOG_DIR/mine_pairs.log" \
          || { echo "stage 2 failed: pair mining (log $LOG_DIR/mine_pairs.log)" >&2; exit 1; }
      fi
      "$PY" "${PREF_LAUNCH[@]}" train_dpo.py --model "$HF_MODEL_DIR" --pairs "$PAIRS_FILE" --out-dir "$MERGED_DIR" \
        --trainer "$TRAINER" "${PREF_ARGS[@]}" 2>&1 | tee -a "$LOG_DIR/train_$TRAINER.log" \
        || { echo "stage 2 failed: ${TRAINER^^} training (log $LOG_DIR/train_$TRAINER.log)" >&2; exit 1; } ;;
  esac
  private_ray_dir  # a token Ray created during training
  done_stage 2
fi

if stage 3; then
  case $TRAINER in
    grpo)
      need_venv
      if is_head; then
        banner 3 "merge FSDP shards of every saved step" "$MERGED_DIR/step_N"
        "$PY" merge_checkpoints.py --ckpt-dir "$CKPT_DIR" --out-dir "$MERGED_DIR" --base-model "$HF_MODEL_DIR"
        if multi_node; then head_mark merged; fi
      else
        banner 3 "the head merges; this node waits for its marker" "$NODES_DIR/merged"
        await_head merged "every saved step merged"
      fi
      done_stage 3 ;;
    dpo|kto) banner 3 "nothing to merge: ${TRAINER^^} writes merged checkpoints" "$MERGED_DIR/step_N" ;;
  esac
fi

if stage 4; then
  need_venv
  banner 4 "synthesise the dev and test sets with every model and score CER" "$EVAL_DIR/{report.md,summary.json,cer.png}"
  DEV_ARGS=()
  if [[ -n $DEV_SET ]]; then
    [[ -f $DEV_SET ]] || { echo "dev set $DEV_SET not found: run stage 0 first (it holds the dev set out)" >&2; exit 1; }
    DEV_ARGS=(--dev-set "dev=$DEV_SET")
  fi
  # several nodes: each scores its share of the models (one torchrun per node, EVAL_DIR shared);
  # node 0 waits for the other shares' markers, scores what is left and writes the report
  SHARE_ARGS=()
  if (( ${NNODES:-1} > 1 )); then
    SHARE_ARGS=(--node-share "${NODE_RANK:-0}/${NNODES:-1}")
    if (( ${NODE_RANK:-0} == 0 )); then
      SHARE_ARGS+=(--wait-shares "${SHARE_WAIT_S:-7200}")
    fi
  fi
  # ttsrl.lifeline: torchrun (and, through infer_dataset.py, its ranks) dies with this script
  "$PY" -m ttsrl.lifeline "$PY" -m torch.distributed.run --standalone --nproc_per_node "$EVAL_NPROC" infer_dataset.py \
    --start-model "$HF_MODEL_DIR" --merged-dir "$MERGED_DIR" --out-dir "$EVAL_DIR" "${DEV_ARGS[@]}" "${SHARE_ARGS[@]}" \
    "${EVAL_ARGS[@]}"
  done_stage 4
fi

if stage 5 && head_only 5; then
  need_venv
  banner 5 "export the step chosen on the dev set (or EXPORT_STEP) to CosyVoice2's llm.pt" "$EXPORT_PATH"
  "$PY" huggingface_to_pretrained.py --from-sweep "$EVAL_DIR/summary.json" --merged-dir "$MERGED_DIR" \
    --start-model "$HF_MODEL_DIR" ${EXPORT_STEP:+--step "$EXPORT_STEP"} --output-path "$EXPORT_PATH" --verify
  done_stage 5
fi

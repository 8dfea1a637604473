#!/usr/bin/env bash
# Sets up .venv and runs every test, the slow end-to-end ones included (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# A module that starts Ray inside the test process (itself, or through tests/serving.py's local_app) gets
# an interpreter of its own: a second in-process cluster inherits process-wide state from the first
# (Serve's handle router, Train's controller bookkeeping) and fails in ways neither module does alone.
# So does one that runs vLLM in the test process (it binds the process's OpenMP threads).
own_process=$(grep -lE "ray\.init\(|local_app\(|importorskip\(\"vllm\"\)" tests/test_*.py)
ignored=()
for module in $own_process; do ignored+=("--ignore=$module"); done
.venv/bin/python -m pytest -m "slow or not slow" "${ignored[@]}" "$@"
for module in $own_process; do
  .venv/bin/python -m pytest -m "slow or not slow" "$module" "$@"
done

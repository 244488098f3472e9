#!/usr/bin/env bash
# The test command (README): sets up .venv on a fresh machine, then runs the fast suite.
# Extra pytest arguments are passed through, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m pytest -m "not slow" -q "$@"

#!/usr/bin/env bash
# The main demo (README): sets up .venv on a fresh machine, then runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m examples.poisson_quickstart "$@"

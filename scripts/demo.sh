#!/usr/bin/env bash
# The main demo (README; docs/demonstration.md): sets up .venv on a fresh machine, then trains
# the CPU cavity demonstration (examples/configs/ldc_demo.yaml, seed 0) in fp32, plain fp16 and
# fp16 with the DerivScaler, and prints the results table (runs/demo/results.md, plots in
# runs/demo/seed0).
# Extra arguments go to `python -m examples.demo`, e.g. `--seeds 0 1 2` or `--modes fp32 bf16`.
# `bash scripts/demo.sh --quick` runs the one-minute Poisson quickstart instead.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
if [ "${1:-}" = "--quick" ]; then
  shift
  exec python -m examples.poisson_quickstart "$@"
fi
exec python -m examples.demo --config ldc_demo --seeds 0 --modes fp32 fp16_plain fp16_scaler_per_order \
  --workdir runs/demo "$@"

#!/usr/bin/env bash
# GPU benchmark of the 6x512 LDC (batch lid/no-slip/interior 1000/1000/4000): every precision
# mode's step time, DerivScaler overhead, TFLOP/s against the device's peak, derivative engines
# by order, and per-mode peak device memory (fresh process each). Sized for < 8 min on one
# H200 including compilation (--time-budget stops starting new work after 6 min).
# Needs a Python with jax[cuda12] and this checkout installed: pip install -e '.[cuda12]'.
# Usage: benchmarks/gpu.sh [results.json]   (default: bench_gpu.json; table on stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench_gpu.json}"
PY="${PYTHON:-python}"
# No pre-allocation: the memory section's child processes need the GPU while this one holds it,
# and the device peak they report must be what the step uses, not the pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()' \
  || { echo "gpu.sh: JAX sees no GPU (install jax[cuda12])" >&2; exit 2; }
exec "$PY" -m benchmarks --preset gpu --time-budget 360 --out "$OUT"

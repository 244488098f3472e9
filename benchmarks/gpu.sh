#!/usr/bin/env bash
# GPU check of docs/gpu.md and docs/benchmarks.md, <= 16 min on one H100/H200 with compilation:
#  0. the steps of docs/gpu.md (the README Poisson at 4x128/20 000 and 4x512/6 000 points and the
#     cavity at Modulus' size, 6x512 with 4 000/1 000/1 000 points, every precision mode) compiled
#     for this GPU and timed, the measured times beside the time model's
#     (python -m benchmarks gpu_program --time 50), <= 6 min;
#  1. the 6x512 LDC step (interior/lid/no-slip 4000/1000/1000) in fp32_highest, bf16, fp16_plain,
#     fp16_noscale and fp16_scaled_order: XLA's cost on the GPU, the roofline prediction, and the
#     measured step times and speed-ups over fp32 (python -m benchmarks roofline --time), <= 4 min;
#  2. the problem matrix at its GPU preset (python -m benchmarks matrix --preset gpu), <= 3 min;
#     the JSON is written after every problem, so a cut run keeps what it measured;
#  3. the same LDC step with per-tensor scaling: fp16_scaled_order, fp16_tensor and the FP8 modes
#     fp8_default (cotangents E4M3) and fp8_all (tangents and cotangents E4M3), <= 3 min
#     (docs/tensor_scaling.md, "Roofline projection (H200, on paper)").
# Needs a Python with jax[cuda12] and this checkout installed: pip install -e '.[cuda12]'.
# Usage: benchmarks/gpu.sh [DIR]   (default DIR: benchmarks/results; tables on stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-benchmarks/results}"
DATE="$(date +%Y-%m-%d)"
PY="${PYTHON:-python}"
mkdir -p "$DIR"
# No pre-allocation: XLA's allocator statistics then show what the steps use, not the pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()' \
  || { echo "gpu.sh: JAX sees no GPU (install jax[cuda12])" >&2; exit 2; }
"$PY" -c 'import jax; print(jax.devices()[0].device_kind, jax.__version__)'
status=0
timeout 360 "$PY" -m benchmarks gpu_program --time 50 --out "$DIR/gpu_program-time-gpu-$DATE.json" \
  || { echo "gpu.sh: gpu_program stopped (status $?)" >&2; status=1; }
timeout 240 "$PY" -m benchmarks roofline --time --reps 20 --inner 5 --out "$DIR/roofline-gpu-$DATE.json" \
  || { echo "gpu.sh: roofline stopped (status $?)" >&2; status=1; }
timeout 180 "$PY" -m benchmarks matrix --preset gpu --problems unsteady_ns cavity ks poisson1d \
  --out "$DIR/matrix-gpu-$DATE.json" || { echo "gpu.sh: matrix stopped (status $?)" >&2; status=1; }
timeout 180 "$PY" -m benchmarks roofline --time --reps 20 --inner 5 \
  --modes fp16_scaled_order fp16_tensor fp8_default fp8_all --out "$DIR/roofline-fp8-gpu-$DATE.json" \
  || { echo "gpu.sh: roofline (FP8) stopped (status $?)" >&2; status=1; }
exit "$status"

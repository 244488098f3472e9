#!/usr/bin/env bash
# The test command (README): sets up .venv on a fresh machine, then runs the fast suite
# (everything not marked slow; .ci/run also runs the slow end-to-end tests) on one pytest-xdist
# worker per core, each test file on one worker (module fixtures compile once). It prints the
# ten slowest tests. It also runs every docstring example under jaxamp/ (--doctest-modules;
# tests/ holds no doctests, and collecting it that way imports each module once, as usual).
# Extra pytest arguments are passed through, e.g. `bash scripts/test.sh tests/test_models.py`
# (a path given replaces the default `tests jaxamp`; `jaxamp/step.py` runs that file's
# doctests), `bash scripts/test.sh -n 0` (no workers) or `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# The fast suite's time is mostly XLA compiling small programs: the LLVM backend at optimization
# level 0 and the CPU's older elementwise emitters (not its MLIR fusion emitters) compile them in
# about two thirds of the time. The two together move where a few float16 values round inside
# a fusion (the one-graph worker's strict cavity: 5 of 2403 weight-gradient entries), so the
# bit-exactness oracles run in workers of their own under XLA's defaults, and the slow suite, run
# by .ci/run, compiles with XLA's defaults. XLA stops on a flag it does not know: the emitters'
# flag is passed only where the installed jaxlib has it.
fast="--xla_backend_optimization_level=0"
if XLA_FLAGS="$fast --xla_cpu_use_fusion_emitters=false" python -c "import jax; jax.jit(abs)(1.0)" 2>/dev/null; then
  fast="$fast --xla_cpu_use_fusion_emitters=false"
fi
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$fast"
paths=(tests jaxamp)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then paths=(); break; fi
done
python -m pytest -m "not slow" -q -n auto --dist loadfile --durations=10 \
  --doctest-modules -o doctest_optionflags="NORMALIZE_WHITESPACE ELLIPSIS" ${paths[@]+"${paths[@]}"} "$@"

# Sourced by scripts/*.sh: create/activate .venv and install jaxamp with what tests and
# examples need. torch is pinned to the CPU build that pip finds locally (an unpinned torch
# would pull a multi-GB CUDA build); TORCH_INDEX_URL, when set, is the index torch comes from
# (the README's CPU-only line: TORCH_INDEX_URL=<its --index-url> bash scripts/test.sh).
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.jaxamp-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  python -m pip install -q -e ".[test,examples,torch]"
  touch "$stamp"
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

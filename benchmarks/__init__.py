"""Benchmarks for jaxamp: step time per precision mode, DerivScaler overhead, JAX vs torch_ref,
derivative engines by order, and memory. Run ``python -m benchmarks --help``."""

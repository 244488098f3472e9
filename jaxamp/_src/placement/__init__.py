"""Precision placement for any JAX network: :func:`jaxamp.autocast` (rewrite) with its
per-primitive rule (rules) and the per-tensor scaled matmul (tensor_scale)."""

__all__: list = []

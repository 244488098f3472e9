"""Precision placement for any JAX network: :func:`jaxamp.autocast` (:mod:`~jaxamp.placement.rewrite`)
with its per-primitive rule (:mod:`~jaxamp.placement.rules`)."""

__all__: list = []

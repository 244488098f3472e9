"""Scaled input derivatives of a per-point network: the DerivScaler's derivative engine.

Names follow Modulus (``u__x`` is du/dx, ``u__x__y`` is d/dy(du/dx)); each step follows
docs/algorithm.md "One derivative step". Modules: :mod:`~jaxamp.derivatives.plan` (the plan every engine reads),
:mod:`~jaxamp.derivatives.forward` (the default engine); :mod:`jaxamp.engine` builds
:class:`jaxamp.Derivatives` on them, and :func:`jaxamp.scaled` gives the engine's program its
scales and collects its flags.
"""

__all__: list = []

"""What emits marks: ``grad`` and its siblings, ``laplacian``, chains of nested ``grad`` (one
``chain_p`` equation each), the plan and forward engine behind :class:`jaxamp.Derivatives`.
Names follow Modulus (``u__x`` is du/dx, ``u__x__y`` is d/dy(du/dx))."""

__all__: list = []

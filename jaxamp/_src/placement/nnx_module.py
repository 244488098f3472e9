""":func:`jaxamp.autocast` of a Flax NNX module: a module again (:class:`AutocastNNX`) holding the
network as its submodule ``.module`` (its variables are the network's, updated in place as it
trains), so code that takes "a module" (``nnx.Optimizer(model, ...)``, ``nnx.grad``) trains the
placed network. Imported only when ``flax.nnx`` is."""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx

__all__ = ["AutocastNNX"]


class AutocastNNX(nnx.Module):
    """``module`` with jaxamp's precision placement: calling it is ``autocast(module, amp)(...)``.

    Args:
      module: the network (a submodule: its variables are this module's, under ``.module``).
      amp, argnums, params_argnums: as :func:`jaxamp.autocast` (``argnums``: a tuple).
      place: ``jaxamp._src.placement.rewrite.placed_function`` (given, not imported: the placement
        imports this module).
    """

    def __init__(self, module: Any, amp: Any, argnums: Any, params_argnums: Any, place: Callable[..., Callable]):
        self.module = module
        self.amp, self.argnums, self.params_argnums, self.place = amp, argnums, params_argnums, place

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # placed for the module as it is now (its variables change in place as it trains)
        return self.place(self.module, self.amp, True, self.argnums, self.params_argnums)(*args, **kwargs)

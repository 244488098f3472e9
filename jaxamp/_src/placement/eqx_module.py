""":func:`jaxamp.autocast` of an Equinox module: a module again (:class:`AutocastModule`), whose
leaves are the network's, so a library that trains "a module" (jinns's ``eqx_network=``,
``eqx.filter_grad``, ``eqx.apply_updates``) trains the placed network. Imported only when
Equinox is (an optional extra)."""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx

__all__ = ["AutocastModule"]


class AutocastModule(eqx.Module):
    """``module`` with jaxamp's precision placement: calling it is ``autocast(module, amp)(...)``.

    Attributes:
      module: the network (its arrays are this module's arrays: same leaves, same paths under
        ``.module``).
      amp, params_argnums: as :func:`jaxamp.autocast` (static); argnums: ``params_argnums`` as a tuple.
      place: ``jaxamp._src.placement.rewrite.placed_function`` (static; given, not imported: the
        placement imports this module).
    """

    module: Any
    amp: Any = eqx.field(static=True)
    argnums: Any = eqx.field(static=True)
    params_argnums: Any = eqx.field(static=True)
    place: Callable[..., Callable] = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # placed for the module as it is now (its leaves change as it trains)
        return self.place(self.module, self.amp, True, self.argnums, self.params_argnums)(*args, **kwargs)

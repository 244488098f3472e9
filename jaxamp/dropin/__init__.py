"""Drop-in derivative scaling for JAX code written with ``jax.grad``.

Write derivatives with :func:`grad` (``jax.grad``'s signature) and wrap the function that
uses them with :func:`scaled`, which supplies the scales and returns the overflow flags.

>>> import jax.numpy as jnp, jaxamp
>>> u_net = lambda p, t, x: jnp.sin(p * x) * jnp.exp(-t)
>>> u_t = jaxamp.grad(u_net, argnums=1, of="u", wrt="t")
>>> u_xx = jaxamp.grad(jaxamp.grad(u_net, argnums=2, of="u", wrt="x"), argnums=2, wrt="x")
>>> loss_fn = lambda p, t, x: (u_t(p, t, x) - 0.1 * u_xx(p, t, x)) ** 2
>>> loss, found_inf = jaxamp.scaled(loss_fn)({"1": 1.0, "2": 0.5}, 2.0, 0.0, 0.3)
>>> sorted(found_inf)
['1', '2', 'nonfinite_values']

Nests of ``grad`` along float32 scalar arguments run as :class:`jaxamp.Derivatives` plans.
Siblings, scaled and checked the same way: :func:`jacrev`, :func:`jacfwd`, :func:`jvp`,
:func:`hessian`; :func:`jaxamp.profile` and :func:`jaxamp.init` measure and start the scales.

A ``grad``'s order (its key) is 1 + the highest order of the derivatives its function's value
depends on, read from the traced program (:mod:`jaxamp.nesting`): the same under any
``jax.jit``, ``jax.checkpoint``, custom derivative, loop or branch between nested ``grad`` s.
"""

__all__: list = []

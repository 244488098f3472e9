"""Drop-in derivative scaling for JAX code written with ``jax.grad``.

Write derivatives as usual with :func:`grad` (``jax.grad``'s signature) and wrap the
function that uses them with :func:`scaled`, which supplies the scales and returns the
overflow flags: no signature of the user's code changes.

>>> import jax.numpy as jnp, jaxamp
>>> u_net = lambda p, t, x: jnp.sin(p * x) * jnp.exp(-t)
>>> u_t = jaxamp.grad(u_net, argnums=1, of="u", wrt="t")
>>> u_xx = jaxamp.grad(jaxamp.grad(u_net, argnums=2, of="u", wrt="x"), argnums=2, wrt="x")
>>> loss_fn = lambda p, t, x: (u_t(p, t, x) - 0.1 * u_xx(p, t, x)) ** 2
>>> loss, found_inf = jaxamp.scaled(loss_fn)({"1": 1.0, "2": 0.5}, 2.0, 0.0, 0.3)
>>> sorted(found_inf)
['1', '2', 'nonfinite_values']

:func:`jaxamp.autocast` gives the user's own network jaxamp's precision placement.

What to use when:

- :class:`jaxamp.Derivatives` (engine with named inputs/outputs): new code, or many
  derivatives of a multi-output network. It chooses the fastest method (nested forward
  mode, Taylor mode for high pure orders, shared passes); :func:`scaled` gives it its
  scales, as to these derivatives.
- :func:`grad` + :func:`scaled`: existing code written with ``jax.grad`` (scalar
  ``u_net(params, t, x)``, residuals under ``vmap``, ``jacrev`` of the residuals for loss
  weights). Nests of ``grad`` along float32 scalar arguments run as the engine's plans
  (``method="auto"``: nested forward mode, Taylor mode, shared passes); ``method="reverse"``
  is the engine's ``method="reverse"`` step itself (the engine writes it with this
  ``grad``), under the same scaler keys (per order; per term and special terms with
  ``of=``/``wrt=`` names).

Siblings with the JAX signatures, scaled and checked the same way: :func:`jacrev` (any output
array), :func:`jacfwd` and :func:`jvp` (forward mode: the tangent seed carries the scale) and
:func:`hessian` (``jacfwd`` of ``jacrev``). :func:`profile` measures where a program's scaled
derivatives sit in float16's window; :func:`init_scalers` starts every key from it.

Keys: the order of a ``grad`` is 1 + the highest order of the ``grad`` calls made while its
function is evaluated, found when it is traced. A function that calls ``grad`` through a
``jax.jit`` whose trace is cached from an earlier call (the same jitted function called
again with the same shapes inside another ``grad``) reports nothing, and the outer ``grad``
gets a lower order: put ``jax.jit`` around the whole loss, not between nested ``grad`` s.
"""

"""Faults injected as jaxamp's engines raise them, for the optimizer's tests (tests/test_optax_compose.py,
tests/test_optax_recipes.py): a float16 config with a small loss scale, a parameter vector, and
:func:`inject`, a derivative flag set where asked, and :func:`poison_grad`, non-finite weight
gradients under a finite loss (as a backward pass overflowing under its loss scale gives them)."""

import jax
import jax.numpy as jnp

import jaxamp

AMP = jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**8})
N = 16
PARAMS = {"w": jnp.linspace(0.5, 1.5, N)}


def inject(hit, order):
    """A flag raised as an engine raises it: an overflow of key ``order`` where ``hit``."""
    return jaxamp._src.core.marks.deriv_check(jnp.where(hit, jnp.inf, 0.0), jnp.float32(0.0), order=order, term=None)


def amp_state():
    """The AMP state of :data:`AMP` with derivative keys "1" and "2"."""
    return jaxamp.init(None, AMP, keys=["1", "2"])()


@jax.custom_jvp
def poison_grad(x, hit):
    """``x``, whose derivative is infinite where ``hit``: the loss stays finite, its gradients do not."""
    return x


@poison_grad.defjvp
def _poison_grad_jvp(primals, tangents):
    x, hit = primals
    return x, tangents[0] * jnp.where(hit, jnp.inf, 1.0).astype(jnp.result_type(x))

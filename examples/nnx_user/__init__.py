"""A 1-D Poisson PINN written the way a Flax NNX user writes one with JAX's own transforms
(fp32.py: NNX modules are pytrees, so ``jax.grad(jax.grad(model))``, ``jax.value_and_grad``
and ``jax.jit`` take the module itself), and its float16 + DerivScaler port (fp16.py): the
network under ``jaxamp.autocast`` in ``__call__``, its derivatives by ``jaxamp.grad``, one AMP
state from a float32 profile, ``jaxamp.optimizer`` and ``jaxamp.value_and_grad`` (the module's
inexact array leaves are differentiated; the gradients are module-shaped), its ``flags`` given
to the update: ``optim.update(grads, opt_state, model, flags=flags)``.

    python -m examples.nnx_user.fp16 --steps 2000   (from the repository root)
"""

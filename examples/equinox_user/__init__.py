"""A 1-D Poisson PINN written the way an Equinox tutorial writes one (fp32.py), and its float16
+ DerivScaler port (fp16.py): the module under ``jaxamp.autocast`` in its ``__call__``, its
derivatives by ``jaxamp.grad``, one AMP state from a float32 profile, ``jaxamp.optimizer`` and
``jaxamp.value_and_grad`` in place of ``eqx.filter_value_and_grad`` (the same filter semantics:
the module's inexact array leaves are differentiated, the gradients are module-shaped), its
``flags`` given to the update: ``optim.update(grads, opt_state, params, flags=flags)``.

    python -m examples.equinox_user.fp16 --steps 2000   (from the repository root)
"""

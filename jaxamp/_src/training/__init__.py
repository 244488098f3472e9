"""Training: :func:`jaxamp.init` (start), the step decision (step), the optax optimizer and
value_and_grad (optim), make_train_step (train), monitor, parallel, checkpoint."""

__all__: list = []

"""jaxamp's implementation, in layers whose imports point down only (tests/test_layering.py):

  scaling      settings (AmpConfig and its value checks), the scaler rules, AmpState
  core         the marks, the key rule, the one interpreter (scaled), profile, the float16 window,
               the autocast policy, module detection
  taylor       Taylor-mode rules and their interpreter
  derivatives  what emits marks: grad and siblings, laplacian, chains, the Derivatives engine
  placement    autocast's per-primitive precision rules, per-tensor scaling and FP8
  training     init, the step decision, the optimizer, make_train_step, monitor, parallel,
               checkpoint
  models       Flax networks

The public names are those of :mod:`jaxamp` and its public modules (``jaxamp.models``,
``jaxamp.parallel``); nothing under ``_src`` is a stable name.
"""

__all__: list = []

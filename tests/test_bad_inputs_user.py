"""Realistic user-API mistakes (a port of a Flax / JAX PINN to jaxamp) get a clear jaxamp error
before any work: one row per mistake with the exception type and fragments the message must hold
(the argument, the value and the fix). No error may come out of JAX, Flax, optax or orbax.
"""

import os
import tempfile
import traceback
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp import AmpConfig, ConfigError
from jaxamp import UnscaledDerivativeWarning
from tests.helpers.files import yaml_file

FP16 = AmpConfig()
MODEL = nn.Sequential([nn.Dense(8), jnp.tanh, nn.Dense(8), jnp.tanh, nn.Dense(1)])
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.ones((4, 2)))
X = jnp.linspace(0.0, 1.0, 8).reshape(4, 2)
NET = jaxamp.autocast(MODEL.apply, FP16)


def u(params, t):
    return NET(params, jnp.stack([t, t])[None])[0, 0]


def loss(params, x):
    """A drop-in PINN loss: jaxamp.grad of the autocast network."""
    return jnp.mean(jax.vmap(lambda t: jaxamp.grad(jaxamp.grad(u, 1), 1)(params, t))(x[:, 0]) ** 2)


def loss_with_jax_grad(params, x):
    """The port's most likely slip: jax.grad left in the loss."""
    return jnp.mean(jax.vmap(lambda t: jax.grad(jax.grad(u, 1), 1)(params, t))(x[:, 0]) ** 2)


def state():
    return jaxamp.init(loss, FP16, from_profile=False)(PARAMS, X)


def as_error(fn):
    """``fn`` with jaxamp's warnings raised as errors (the table's runner expects an exception)."""
    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnscaledDerivativeWarning)
            return fn()
    return call


def checkpointer():
    return jaxamp.Checkpointer(tempfile.mkdtemp())


def argnums_slip():
    """Gradients with respect to the points (argnums=1) handed to the optimizer of the params."""
    amp_state = jaxamp.init(loss, FP16, from_profile=False)(PARAMS, X)
    tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)
    opt_state = tx.init(PARAMS)
    _, grads, flags = jaxamp.value_and_grad(loss, argnums=1)(opt_state, PARAMS, X)
    return tx.update(grads, opt_state, PARAMS, flags=flags)


CASES = [
    # ---------------------------------------------------------------- AmpConfig from a user's config
    ("config.unknown_key", lambda: AmpConfig(**{"dtype": "float16", "precision": "fp16"}), ConfigError,
     ["unknown key(s) ['precision']", "allowed keys are ['enabled'", "remove or rename"]),
    ("config.positional", lambda: AmpConfig("float16"), ConfigError,
     ["positional value(s) ['float16']", "by name, e.g. AmpConfig(**config.amp)"]),
    ("config.dtype_alias", lambda: AmpConfig(dtype="fp16"), ConfigError,
     ["amp.dtype='fp16'", "one of ['float16', 'bfloat16', 'float32', 'float8']"]),
    ("config.dtype_float64", lambda: AmpConfig(dtype=jnp.float64), ConfigError,
     ["amp.dtype=<class 'jax.numpy.float64'>", "'float16'"]),
    ("config.enabled_string", lambda: AmpConfig(enabled="false"), ConfigError,
     ["amp.enabled='false'", "true or false"]),
    ("config.scale_not_log2", lambda: AmpConfig(custom_max_scales_log2={2: 1024.0}), ConfigError,
     ["custom_max_scales_log2[2]", "1024.0", "integer exponent", "2**value"]),
    ("config.empty_term", lambda: AmpConfig(special_terms=["nu", ""]), ConfigError,
     ["amp.special_terms", "['nu', '']", "non-empty variable names"]),
    ("config.nested_not_mapping", lambda: AmpConfig(loss_scaler=1024.0), ConfigError,
     ["amp.loss_scaler=1024.0", "a mapping with keys among ['init_scale'"]),
    ("config.yaml_missing_file", lambda: AmpConfig.from_yaml("no_such_config.yaml"), FileNotFoundError,
     ["no_such_config.yaml"]),
    ("config.yaml_whole_file",
     lambda: AmpConfig.from_yaml(yaml_file("amp:\n  dtype: float16\ntraining:\n  steps: 10\n")),
     ConfigError, ["config.yaml", "unknown key(s) ['amp', 'training']", "allowed keys are", "pass its amp section"]),
    # ---------------------------------------------------------------- jaxamp.init
    ("init.amp_dict", lambda: jaxamp.init(loss, {"dtype": "float16"}), TypeError,
     ["`amp`={'dtype': 'float16'}", "must be an AmpConfig", "AmpConfig(**config.amp)"]),
    ("init.amp_class", lambda: jaxamp.init(loss, AmpConfig), TypeError,
     ["`amp`=<class 'jaxamp.AmpConfig'>", "build one with AmpConfig(...)"]),
    ("init.loss_value", lambda: jaxamp.init(loss(PARAMS, X), FP16), TypeError,
     ["`fun`=Array(", "must be callable", "jaxamp.init(loss, amp)(params, batch)"]),
    ("init.no_arguments", lambda: jaxamp.init(loss, FP16)(), TypeError,
     ["`fun`=loss failed on no arguments", "missing 2 required positional arguments",
      "jaxamp.init(loss, amp)(params, batch)"]),
    ("init.margin", lambda: jaxamp.init(loss, FP16, margin_log2=-1), ValueError,
     ["jaxamp.init: `margin_log2`=-1", "an integer in [0, 15]"]),
    ("init.from_profile", lambda: jaxamp.init(loss, FP16, from_profile="yes"), TypeError,
     ["`from_profile`='yes'", "True or False"]),
    ("init.keys_ints", lambda: jaxamp.init(None, FP16, keys=[1, 2]), TypeError,
     ["`keys`=[1, 2]", "scaler keys (strings)"]),
    ("init.bf16_state_fp16_net", lambda: jaxamp.init(loss, AmpConfig(dtype="bfloat16"))(PARAMS, X), ConfigError,
     ["autocast(Sequential.apply) runs under", "amp.dtype='float16'", "amp.dtype='bfloat16'",
      "pass the same AmpConfig"]),
    ("init.plain_state_scaled_net", lambda: jaxamp.init(loss, AmpConfig(derivative_scaling=False))(PARAMS, X),
     ConfigError, ["derivative_scaling=True vs derivative_scaling=False", "pass the same AmpConfig to both"]),
    ("init.off_state_fp16_net", lambda: jaxamp.init(loss, AmpConfig(enabled=False))(PARAMS, X), ConfigError,
     ["enabled=True vs enabled=False", "autocast(model.apply, amp) and jaxamp.init(loss, amp)"]),
    # ---------------------------------------------------------------- jaxamp.autocast
    ("autocast.flax_module", lambda: jaxamp.autocast(MODEL, FP16), TypeError,
     ["`fn`=Sequential(...)", "Flax module", "autocast(model.apply, amp)"]),
    ("autocast.flax_call", lambda: jaxamp.autocast(MODEL.__call__, FP16), TypeError,
     ["`fn`=Sequential.__call__", "autocast(model.apply, amp)"]),
    ("autocast.output_not_fn", lambda: jaxamp.autocast(MODEL.apply(PARAMS, X), FP16), TypeError,
     ["`fn`=Array(", "must be callable", "autocast(model.apply, amp), not its output"]),
    ("autocast.swapped_args", lambda: NET(X, PARAMS), TypeError,
     ["autocast(Sequential.apply)", "`params`, is an array of shape (4, 2)", "apply(params, x)"]),
    ("autocast.amp_string", lambda: jaxamp.autocast(MODEL.apply, "float16"), TypeError,
     ["`amp`='float16'", "AmpConfig(...) or AmpConfig.from_dict(cfg)"]),
    ("autocast.no_amp", lambda: jaxamp.autocast(MODEL.apply), TypeError,
     ["autocast(Sequential.apply): `amp` is missing", "the AmpConfig that jaxamp.init gets", "autocast(fn, amp)"]),
    ("autocast.params_argnums", lambda: jaxamp.autocast(MODEL.apply, FP16, params_argnums="params"), ValueError,
     ["`params_argnums`='params'", "an int >= 0", "0 for apply_fn(params, x)"]),
    # ---------------------------------------------------------------- value_and_grad / scaled / profile
    ("vag.params_first", lambda: jaxamp.value_and_grad(loss)(PARAMS, X), TypeError,
     ["jaxamp.value_and_grad", "got dict holding 0 AmpState(s)", "Fix: pass the state first"]),
    ("vag.plain_optax_state", lambda: jaxamp.value_and_grad(loss)(optax.adam(1e-3).init(PARAMS), PARAMS, X), TypeError,
     ["holding 0 AmpState(s)", "jaxamp.optimizer(tx, amp_state=jaxamp.init(loss, amp)(params, batch))"]),
    ("vag.argnums_slip", lambda: argnums_slip(), TypeError,
     ["jaxamp.optimizer", "`params`", "argnums=1", "Fix: differentiate the parameters"]),
    ("scaled.state_forgotten", lambda: jaxamp.scaled(loss)(PARAMS, X), TypeError,
     ["jaxamp.scaled", "the first argument", "AmpState", "Fix: pass the state first"]),
    ("scaled.amp_ignored", lambda: jaxamp.scaled(loss, AmpConfig(dtype="bfloat16"))(state(), PARAMS, X),
     ConfigError, ["jaxamp.scaled", "`amp`", "bfloat16", "float16"]),
    ("profile.amp_dict", lambda: jaxamp.profile(loss, {"dtype": "float16"}), TypeError,
     ["jaxamp.profile: `amp`={'dtype': 'float16'}", "AmpConfig"]),
    ("profile.scales_float", lambda: jaxamp.profile(loss, FP16)(3.0, PARAMS, X), TypeError,
     ["`state`=3.0", "must be None (every scale 1)", "Fix: pass the state first"]),
    ("profile.params_first", lambda: jaxamp.profile(loss, FP16)({"w": 1.0}, PARAMS, X), KeyError,
     ["jaxamp.profile", "['w']", "is the first argument the state?"]),
    ("profile.not_callable", lambda: jaxamp.profile("loss"), TypeError, ["`fun`='loss'", "must be callable"]),
    # ---------------------------------------------------------------- checkpoints
    ("ckpt.restore_empty", lambda: checkpointer().restore({"w": jnp.ones(2)}), FileNotFoundError,
     ["no checkpoint in", "to restore"]),
    ("ckpt.directory_none", lambda: jaxamp.Checkpointer(None), TypeError,
                 ["Checkpointer: `directory`=None", "a path"]),
    ("ckpt.save_dict_without_step", lambda: checkpointer().save({"w": jnp.ones(2)}), TypeError,
                 ["`state`", "has no .step", "pass step="]),
    ("ckpt.negative_step", lambda: checkpointer().save({"w": jnp.ones(2)}, step=-1), ValueError,
                 ["`step`=-1", "an integer >= 0"]),
]

FOREIGN = tuple(f"{os.sep}{name}{os.sep}" for name in ("jax", "jaxlib", "flax", "optax", "orbax"))


@pytest.mark.parametrize("call, error, fragments", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_user_mistake_is_rejected_clearly(call, error, fragments):
    with pytest.raises(error) as e:
        call()
    message = str(e.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"
    last = traceback.extract_tb(e.value.__traceback__)[-1].filename
    assert not any(part in last for part in FOREIGN), f"the error ends inside {last}"
    assert not type(e.value).__module__.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax")


def test_the_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)

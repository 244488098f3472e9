"""Configs and scaling states serialize: pickle, copy.deepcopy, flax.serialization, equinox and
orbax round-trip them bit for bit, and equal configs hash equal (a jit static argument)."""

import copy
import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import AmpConfig, AmpState
from jaxamp._src.scaling.scaler import DynamicScaler
from jaxamp._src.scaling.config_values import FrozenMapping

CONFIGS = {
    "default": AmpConfig(),
    "bfloat16": AmpConfig(dtype="bfloat16", autocast_activation=True),
    "off": AmpConfig(enabled=False),
    "loss_only": AmpConfig(derivative_scaling=False, loss_scaler={"init_scale": 2.0**10, "growth_interval": 500}),
    "per_term": AmpConfig(mode="per_term_scaler", special_terms=["nu"], default_max_scale_log2=2,
                          custom_max_scales_log2={"x": 5, "nu": 20}, custom_init_scales_log2={"x": -3}),
    "custom": AmpConfig(autocast_firstlayer=True, custom_max_scales_log2={2: -2, 1: 4}, custom_init_scales_log2={2: -6},
                        derivative_scaler={"growth_interval": 300, "backoff_factor": 0.25, "min_scale": 2.0**-40},
                        loss_scaler={"init_scale": 2.0**12, "max_scale": 2.0**20, "recover_threshold": 2.0**3}),
    "tensor_scaling": AmpConfig(tensor_scaling=True),
    "float8": AmpConfig(dtype="float8", float8_formats={"tangent": "float8_e5m2", "value": "float8_e4m3fn"}),
}
KEYS = {"per_term": ["x", "nu", "t"], "custom": ["1", "2", "3"]}  # the rest: orders "1", "2"
COPIES = {
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    **{f"pickle_protocol_{p}": (lambda x, p=p: pickle.loads(pickle.dumps(x, protocol=p))) for p in (0, 2)},
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


def fresh(name: str) -> AmpState:
    return jaxamp.init(None, CONFIGS[name], keys=KEYS.get(name, ["1", "2"]))()


def trained(name: str) -> AmpState:
    """A state after a few steps: every scale backed off and every tracker counting (when the config
    has that scaler), the keys each at their own value, so a restore that resets leaves shows."""
    state = fresh(name)
    keys = list(state.scales)
    for step in range(4):  # key i backs off i + 1 times, then counts clean steps
        flags = {k: step <= i for i, k in enumerate(keys)}
        loss = state.loss if state.loss_rule is None else state.loss_rule.update(state.loss, step < 2)
        state = state.replace(derivative=state.derivative.update(flags), loss=loss)
    state = state.replace(derivative=state.derivative.update({}))
    return state


def leaves(state: AmpState) -> list:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def typed_fields(amp: AmpConfig) -> list:
    """``(name, type, value)`` of every field, and of every entry of a mapping field."""
    out = []
    for field in dataclasses.fields(amp):
        value = getattr(amp, field.name)
        items = value.items() if isinstance(value, FrozenMapping) else [("", value)]
        out += [(f"{field.name}[{k}]", type(v), v) for k, v in items] + [(field.name, type(value))]
    return out


def assert_same_state(got, want: AmpState) -> None:
    """Same type, config, rules, tree and leaves bit for bit (values, dtypes, shapes)."""
    assert type(got) is AmpState
    assert got.amp == want.amp and hash(got.amp) == hash(want.amp)
    assert got.loss_rule == want.loss_rule and dict(got.derivative.rules) == dict(want.derivative.rules)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (a, b)
        assert np.array_equal(a, b)


@pytest.mark.parametrize("name", CONFIGS)
def test_trained_states_leave_every_leaf_off_its_start(name):
    state, start = trained(name), fresh(name)
    moved = [not np.array_equal(a, b) for a, b in zip(leaves(state), leaves(start))]
    scaled = state.amp.loss_scaling_enabled  # the loss scaler moves; and so does each derivative scaler
    assert all(moved) if scaled else not any(moved)
    assert len(set(np.asarray(s).item() for s in state.scales.values())) == len(state.scales)  # distinct


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", CONFIGS)
def test_configs_copy_and_pickle(name, how):
    amp = CONFIGS[name]
    got = COPIES[how](amp)
    assert type(got) is AmpConfig and got == amp and hash(got) == hash(amp) and repr(got) == repr(amp)
    assert got.to_dict() == amp.to_dict() and AmpConfig.from_dict(got.to_dict()) == amp
    assert typed_fields(got) == typed_fields(amp)  # every value of the same type (1024.0 stays a float)
    for key in ("1", "2", "x", "nu"):
        assert got.derivative_scaler_for(key) == amp.derivative_scaler_for(key)
    assert got.make_loss_scaler() == amp.make_loss_scaler() and got.matmul_formats == amp.matmul_formats


@pytest.mark.parametrize("how", COPIES)
def test_dynamic_scalers_copy_and_pickle(how):
    for rule in (DynamicScaler(), CONFIGS["custom"].derivative_scaler_for("2"), CONFIGS["custom"].make_loss_scaler()):
        got = COPIES[how](rule)
        assert got == rule and hash(got) == hash(rule) and repr(got) == repr(rule)
        state = rule.update(rule.init(), True)
        assert np.array_equal(got.update(got.init(), True).scale, state.scale)


def test_mapping_fields_read_as_before_and_stay_read_only():
    amp = CONFIGS["custom"]
    assert amp.custom_max_scales_log2["2"] == -2 and dict(amp.custom_init_scales_log2) == {"2": -6}
    assert amp.custom_max_scales_log2 == {"1": 4, "2": -2} and amp.derivative_scaler.get("growth_interval") == 300
    assert isinstance(amp.loss_scaler, FrozenMapping) and amp.loss_scaler["init_scale"] == 2.0**12
    assert CONFIGS["float8"].float8_formats["tangent"] == "float8_e5m2"
    with pytest.raises(TypeError):
        amp.custom_max_scales_log2["2"] = 0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        amp.custom_max_scales_log2 = {}  # type: ignore[misc]
    assert "custom_max_scales_log2={'1': 4, '2': -2}" in repr(amp)  # a dict's repr, sorted


EQUAL = {
    "dict_order": [dict(custom_max_scales_log2={2: 3, "nu": 20, 1: -1}, custom_init_scales_log2={2: -4, "nu": 1}),
                   dict(custom_init_scales_log2={"nu": 1, "2": -4}, custom_max_scales_log2={"nu": 20, 1: -1, "2": 3})],
    "scaler_order_and_numbers": [dict(loss_scaler={"init_scale": 1024, "growth_interval": 500}),
                                 dict(loss_scaler={"growth_interval": np.int64(500), "init_scale": np.float32(1024)}),
                                 dict(loss_scaler={"growth_interval": 500, "init_scale": 1024.0})],
    "dtype_spelling": [dict(dtype="float16"), dict(dtype=jnp.float16), dict(dtype=np.dtype("float16")), dict()],
    "tensor_scaling_default": [dict(tensor_scaling=None), dict(tensor_scaling=False), dict()],
    "float8_default": [dict(dtype="float8"), dict(dtype="float8", tensor_scaling=True)],
    "float8_formats_order": [dict(dtype="float8", float8_formats={"tangent": "float8_e5m2", "value": "float16"}),
                             dict(dtype="float8", float8_formats={"value": "float16", "tangent": "float8_e5m2"})],
    "special_terms_list": [dict(mode="per_term_scaler", special_terms=["nu", "mu"]),
                           dict(mode="per_term_scaler", special_terms=("nu", "mu"))],
    "bfloat16": [dict(dtype="bfloat16"), dict(dtype=jnp.bfloat16, tensor_scaling=False)],
}


@pytest.mark.parametrize("case", EQUAL)
def test_equal_configs_hash_equal(case):
    built = [AmpConfig(**kwargs) for kwargs in EQUAL[case]]
    built += [AmpConfig.from_dict(built[0].to_dict()), dataclasses.replace(built[-1])]
    built += [pickle.loads(pickle.dumps(built[0]))]
    for amp in built:
        assert amp == built[0] and hash(amp) == hash(built[0]) and repr(amp) == repr(built[0])
    assert len(set(built)) == 1 and {built[0]: "cached"}[built[-1]] == "cached"


def test_equal_configs_from_yaml_and_nested_containers_hash_equal(tmp_path):
    path = tmp_path / "amp.yaml"
    path.write_text("amp:\n  custom_max_scales_log2: {nu: 20, 2: 3}\n  loss_scaler: {init_scale: 1024}\n")
    other = AmpConfig(loss_scaler={"init_scale": 1024.0}, custom_max_scales_log2={"2": 3, "nu": 20})
    assert AmpConfig.from_yaml(path) == other and hash(AmpConfig.from_yaml(path)) == hash(other)


UNEQUAL = [
    (dict(), dict(dtype="bfloat16")),
    (dict(), dict(enabled=False)),
    (dict(custom_max_scales_log2={2: 3}), dict(custom_max_scales_log2={2: 4})),
    (dict(custom_max_scales_log2={2: 3}), dict(custom_max_scales_log2={3: 3})),
    (dict(custom_max_scales_log2={2: 3}), dict(custom_init_scales_log2={2: -3})),
    (dict(custom_init_scales_log2={2: -3}), dict(custom_init_scales_log2={2: -3, 1: -3})),
    (dict(loss_scaler={"init_scale": 1024}), dict(loss_scaler={"init_scale": 2048})),
    (dict(loss_scaler={"init_scale": 1024}), dict(derivative_scaler={"init_scale": 1024.0 / 2**20})),
    (dict(dtype="float8"), dict(dtype="float8", float8_formats={"tangent": "float8_e5m2"})),
    (dict(mode="per_term_scaler", special_terms=["nu", "mu"]),
     dict(mode="per_term_scaler", special_terms=["mu", "nu"])),
    (dict(), dict(tensor_scaling=True)),
]


@pytest.mark.parametrize("a, b", UNEQUAL)
def test_unequal_configs_compare_unequal(a, b):
    first, second = AmpConfig(**a), AmpConfig(**b)
    assert first != second and second != first and len({first, second}) == 2
    assert first != first.to_dict() and first != pickle.loads(pickle.dumps(second))


def test_config_is_a_jit_static_argument_whoever_built_it():
    traces = []

    def scale(x, amp):
        traces.append(amp)
        return x * 2.0 ** amp.max_scale_log2("2")

    scale = jax.jit(scale, static_argnums=1)
    a = AmpConfig(custom_max_scales_log2={2: 3, "nu": 20})
    b = AmpConfig(custom_max_scales_log2={"nu": 20, "2": 3})
    for amp in (a, b, pickle.loads(pickle.dumps(a)), copy.deepcopy(b)):
        assert float(scale(1.0, amp)) == 8.0
    assert len(traces) == 1  # equal configs: one compile
    assert float(scale(1.0, AmpConfig(custom_max_scales_log2={2: 4}))) == 16.0 and len(traces) == 2


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", CONFIGS)
def test_states_copy_and_pickle(name, how):
    state = trained(name)
    got = COPIES[how](state)
    assert_same_state(got, state)


def test_a_restored_state_reuses_the_compiled_step():
    traces = []

    @jax.jit
    def step(state):
        traces.append(1)
        return state.replace(derivative=state.derivative.update({"2": True}))

    state = trained("custom")
    want = step(state)
    assert_same_state(step(pickle.loads(pickle.dumps(state))), want)
    assert_same_state(step(copy.deepcopy(state)), want)
    assert len(traces) == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_flax_state_dict_and_bytes_round_trip(name):
    serialization = pytest.importorskip("flax.serialization")
    state = trained(name)
    state_dict = serialization.to_state_dict(state)
    assert set(state_dict) == {"derivative", "loss"} and set(state_dict["derivative"]) == set(state.scales)
    assert set(state_dict["loss"]) == {"scale", "growth_tracker"}
    assert_same_state(serialization.from_state_dict(fresh(name), state_dict), state)
    assert_same_state(serialization.from_bytes(fresh(name), serialization.to_bytes(state)), state)
    nested = {"amp_state": state, "step": jnp.int32(7)}  # inside a larger checkpoint
    back = serialization.from_bytes({"amp_state": fresh(name), "step": jnp.int32(0)}, serialization.to_bytes(nested))
    assert_same_state(back["amp_state"], state)
    assert int(back["step"]) == 7
    # msgpack_restore gives the same plain state dict (what a checkpoint on disk holds)
    restored = serialization.msgpack_restore(serialization.to_bytes(state))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, restored, state_dict))


def test_flax_restore_into_a_state_of_other_keys_says_so():
    serialization = pytest.importorskip("flax.serialization")
    data = serialization.to_bytes(trained("custom"))
    with pytest.raises(ValueError, match=r"keys \['1', '2', '3'\]; the target state has \['1', '2'\]"):
        serialization.from_bytes(fresh("default"), data)


@pytest.mark.parametrize("name", ["default", "per_term", "custom", "bfloat16"])
def test_equinox_leaves_round_trip(name, tmp_path):
    eqx = pytest.importorskip("equinox")
    state = trained(name)
    eqx.tree_serialise_leaves(tmp_path / "amp.eqx", state)
    assert_same_state(eqx.tree_deserialise_leaves(tmp_path / "amp.eqx", fresh(name)), state)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
@pytest.mark.parametrize("name", ["default", "per_term", "custom"])
def test_orbax_round_trip(name, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    state = trained(name)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "standard", state)
        checkpointer.wait_until_finished()
        assert_same_state(checkpointer.restore(tmp_path / "standard", fresh(name)), state)
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(tmp_path / "pytree", state)
    assert_same_state(checkpointer.restore(tmp_path / "pytree", item=fresh(name)), state)

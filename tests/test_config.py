import pytest

import jaxamp
from jaxamp import AmpConfig, ConfigError


def test_defaults_are_modulus_amp_keys():
    c = AmpConfig()
    assert (c.enabled, c.mode, c.dtype, c.autocast_activation, c.autocast_firstlayer, c.default_max_scale_log2) == (
        True, "per_order_scaler", "float16", False, False, 0)
    assert dict(c.custom_max_scales_log2) == {} == dict(c.custom_init_scales_log2) and c.scaler_enabled
    assert not AmpConfig(dtype="bfloat16").scaler_enabled and not AmpConfig(enabled=False).scaler_enabled
    assert c.derivative_scaling and c.loss_scaling_enabled


def test_plain_fp16_is_a_setting():
    plain = AmpConfig(derivative_scaling=False)
    assert plain.loss_scaling_enabled and not plain.scaler_enabled and plain.compute_dtype == "float16"
    assert not AmpConfig(dtype="bfloat16", derivative_scaling=False).loss_scaling_enabled
    assert AmpConfig.from_dict({"amp": {"derivative_scaling": False}}) == plain
    with pytest.raises(ConfigError, match="amp.derivative_scaling='no' is not allowed: expected true or false"):
        AmpConfig(derivative_scaling="no")
    assert str(AmpConfig(enabled=False, dtype="float16").compute_dtype) == "float32"


def test_from_yaml_with_amp_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "amp:\n  enabled: true\n  mode: per_term_scaler\n  dtype: float16\n  autocast_activation: false\n"
        "  autocast_firstlayer: true\n  default_max_scale_log2: 0\n  custom_max_scales_log2: {2: 3, nu: 20}\n"
        "  custom_init_scales_log2: {2: -4}\n"
        "  special_terms: [nu]\n  derivative_scaler: {growth_interval: 500}\n  loss_scaler: {init_scale: 1024.0}\n"
    )
    c = AmpConfig.from_yaml(path)
    assert c.mode == "per_term_scaler" and c.autocast_firstlayer and c.special_terms == ("nu",)
    assert dict(c.custom_max_scales_log2) == {"2": 3, "nu": 20} and dict(c.custom_init_scales_log2) == {"2": -4}
    assert c.derivative_scaler_for("2").init_scale == 2.0**-4 and c.derivative_scaler_for("nu").init_scale == 1.0
    assert c.derivative_scaler_for("2").max_scale == 8.0 and c.derivative_scaler_for("nu").max_scale == 2.0**20
    assert c.derivative_scaler_for("1").growth_interval == 500
    assert c.make_loss_scaler().init_scale == 1024.0
    assert AmpConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"dtype": "float64"},
         "amp.dtype='float64' is not allowed: expected one of ['float16', 'bfloat16', 'float32', 'float8']"),
        ({"mode": "per_layer"}, "amp.mode='per_layer' is not allowed"),
        ({"enabled": "yes"}, "amp.enabled='yes' is not allowed: expected true or false"),
        ({"default_max_scale_log2": 1.5}, "amp.default_max_scale_log2=1.5"),
        ({"default_max_scale_log2": 500}, "integer exponent in [-126, 127]"),
        ({"custom_max_scales_log2": {0: 2}}, "an order >= 1"),
        ({"custom_max_scales_log2": {2: "big"}}, "custom_max_scales_log2[2]='big'"),
        ({"custom_max_scales_log2": {2: -3}, "derivative_scaler": {"init_scale": 1.0}},
         "amp.derivative_scaler.init_scale=1.0 must not exceed "
         "amp.derivative_scaler.max_scale=0.125; raise max_scale or lower init_scale (max_scale = "
         "2**amp.custom_max_scales_log2['2'])."),
        ({"custom_init_scales_log2": [2]}, "amp.custom_init_scales_log2=[2] is not allowed: expected a mapping"),
        ({"custom_init_scales_log2": {0: -2}}, "amp.custom_init_scales_log2=0 is not allowed: expected an order >= 1"),
        ({"custom_init_scales_log2": {2: 1.5}}, "amp.custom_init_scales_log2[2]=1.5 is not allowed: expected an "
         "integer exponent in [-126, 127] (init scale = 2**value)"),
        ({"custom_init_scales_log2": {2: 1}}, "amp.custom_init_scales_log2['2']=1 is not allowed: expected an integer "
         "exponent in [-126, 0] (a key starts at or below its max scale 2**amp.default_max_scale_log2 = 2**0)"),
        ({"custom_max_scales_log2": {"nu": -9}, "custom_init_scales_log2": {"nu": -3}},
         "amp.custom_init_scales_log2['nu']=-3 is not allowed: expected an integer exponent in [-126, -9] (a key "
         "starts at or below its max scale 2**amp.custom_max_scales_log2['nu'] = 2**-9)"),
        ({"custom_init_scales_log2": {2: -4}, "derivative_scaler": {"min_scale": 0.5}},
         "amp.derivative_scaler.min_scale=0.5 must not exceed amp.derivative_scaler.init_scale=0.0625 (max_scale = "
         "2**amp.default_max_scale_log2, init_scale = 2**amp.custom_init_scales_log2['2'])."),
        ({"special_terms": "nu"}, "amp.special_terms='nu'"),
        ({"derivative_scaler": {"max_scale": 4}}, "amp.derivative_scaler.max_scale=4"),
        ({"loss_scaler": {"growth_interval": 0}}, "amp.loss_scaler.growth_interval=0 is not allowed: expected a "
         "positive integer"),
        ({"derivative_scaler": {"growth_factor": 0.5}}, "amp.derivative_scaler.growth_factor=0.5 is not allowed: "
         "expected a finite number > 1"),
        ({"derivative_scaler": {"backoff_factor": 2.0}}, "amp.derivative_scaler.backoff_factor=2.0 is not allowed: "
         "expected a number in (0, 1)"),
        ({"loss_scaler": {"min_scale": 2.0**31}}, "amp.loss_scaler.min_scale=2147483648.0 must not exceed "
         "amp.loss_scaler.max_scale=1073741824.0"),
        ({"loss_scaler": {"init_scale": float("nan")}}, "amp.loss_scaler.init_scale=nan is not allowed"),
        ({"precision": "fp16"}, "unknown key(s) ['precision']"),
    ],
)
def test_bad_values_are_rejected_with_key_value_and_rule(values, fragment):
    with pytest.raises(ConfigError) as e:
        AmpConfig.from_dict(values)
    assert fragment in str(e.value)


def test_a_negative_max_scale_caps_the_default_init_scale_and_recover_threshold():
    c = AmpConfig(custom_max_scales_log2={2: -9, "nu": -3})
    two, nu, one = (c.derivative_scaler_for(k) for k in ("2", "nu", "1"))
    assert two.init_scale == two.recover_threshold == two.max_scale == 2.0**-9
    assert (nu.init_scale, nu.recover_threshold, nu.max_scale) == (2.0**-3, 2.0**-6, 2.0**-3)
    assert (one.init_scale, one.recover_threshold, one.max_scale) == (1.0, 2.0**-6, 1.0)  # untouched
    scalers = jaxamp.init(None, c, keys=["1", "2"])().derivative
    assert float(scalers["2"].scale) == 2.0**-9 and float(scalers["1"].scale) == 1.0
    # a clean step at the cap stays there; a backoff halves; recover mode grows back to the cap
    rule = two
    state = rule.update(rule.init(), True)
    assert float(state.scale) == 2.0**-10
    for _ in range(rule.recover_growth_interval):
        state = rule.update(state, False)
    assert float(state.scale) == 2.0**-9
    # the default key follows the same rule, and the config round-trips
    d = AmpConfig(default_max_scale_log2=-2).derivative_scaler_for("1")
    assert (d.init_scale, d.recover_threshold) == (0.25, 2.0**-6)
    assert AmpConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("name, value", [("init_scale", 1.0), ("recover_threshold", 2.0**-6)])
def test_an_explicit_value_above_a_negative_max_scale_is_still_an_error(name, value):
    with pytest.raises(ConfigError) as e:
        AmpConfig(custom_max_scales_log2={2: -9}, derivative_scaler={name: value})
    assert f"amp.derivative_scaler.{name}={value!r} must not exceed amp.derivative_scaler.max_scale=0.001953125" in str(
        e.value) and "custom_max_scales_log2['2']" in str(e.value)


def test_explicit_values_below_a_negative_max_scale_are_kept():
    explicit = {"init_scale": 2.0**-12, "recover_threshold": 2.0**-11}
    c = AmpConfig(custom_max_scales_log2={2: -9}, derivative_scaler=explicit)
    rule = c.derivative_scaler_for("2")
    assert (rule.init_scale, rule.recover_threshold, rule.max_scale) == (2.0**-12, 2.0**-11, 2.0**-9)
    # an explicit init_scale applies to every key
    assert c.derivative_scaler_for("1").init_scale == 2.0**-12


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="must be a mapping"):
        AmpConfig.from_dict(["amp"])


class ConfigDictLike:
    """ml_collections.ConfigDict's surface: keys(), items() and item access; not a Mapping."""

    def __init__(self, d):
        self._d = {k: ConfigDictLike(v) if isinstance(v, dict) else v for k, v in d.items()}

    def keys(self):
        return self._d.keys()

    def items(self):
        return self._d.items()

    def __getitem__(self, k):
        return self._d[k]


NESTED = {"dtype": "float16", "special_terms": ["nu"], "custom_max_scales_log2": {2: 3, "nu": 20},
          "custom_init_scales_log2": {2: -4}, "derivative_scaler": {"growth_interval": 500},
          "loss_scaler": {"init_scale": 1024.0}}


def test_mapping_like_configs_are_accepted():
    from omegaconf import OmegaConf

    values = {"amp": {"dtype": "float16", "special_terms": ["nu"], "custom_max_scales_log2": {2: 3},
                      "derivative_scaler": {"growth_interval": 500}}}
    expected = AmpConfig.from_dict(values)
    assert AmpConfig.from_dict(OmegaConf.create(values)) == expected
    assert AmpConfig.from_dict(ConfigDictLike(values)) == expected
    assert expected.special_terms == ("nu",) and expected.derivative_scaler_for("2").max_scale == 8.0


def test_keyword_arguments_take_nested_config_containers():
    """AmpConfig(**config.amp) with a jaxpi-style ConfigDict: every mapping field is a nested
    container (it raised `custom_max_scales_log2=...: expected a mapping`)."""
    expected = AmpConfig(**NESTED)
    got = AmpConfig(**ConfigDictLike(NESTED))
    assert got == expected and hash(got) == hash(expected) and got.to_dict() == expected.to_dict()
    assert dict(got.custom_max_scales_log2) == {"2": 3, "nu": 20} and got.make_loss_scaler().init_scale == 1024.0


def test_keyword_arguments_take_omegaconf_and_ml_collections():
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create({"amp": NESTED})
    assert AmpConfig(**config.amp) == AmpConfig(**NESTED)
    ml_collections = pytest.importorskip("ml_collections")
    assert AmpConfig(**ml_collections.ConfigDict({"amp": NESTED}).amp) == AmpConfig(**NESTED)


def test_unknown_or_positional_arguments_are_config_errors():
    with pytest.raises(ConfigError,
                       match=r"unknown key\(s\) \['precision'\]: allowed keys are \['enabled'.*remove or rename"):
        AmpConfig(**{"dtype": "float16", "precision": "fp16"})
    with pytest.raises(ConfigError, match=r"positional value\(s\) \['float16'\].*e.g. AmpConfig\(\*\*config.amp\)"):
        AmpConfig("float16")


def test_dtype_objects_are_taken_by_name():
    import jax.numpy as jnp
    import numpy as np

    assert AmpConfig(dtype=jnp.bfloat16).dtype == "bfloat16" and AmpConfig(dtype=np.dtype("float16")) == AmpConfig()
    with pytest.raises(ConfigError, match=r"amp.dtype=<class 'jax.numpy.float64'> is not allowed: expected one of"):
        AmpConfig(dtype=jnp.float64)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("amp:\n  dtype: float16\n   mode: per_order_scaler\n")
    with pytest.raises(ConfigError) as e:
        AmpConfig.from_yaml(path)
    assert f"{path}, line 3: not valid YAML" in str(e.value)
    path.write_text("amp:\n  dtype: fp8\n")
    with pytest.raises(ConfigError, match=f"{path}: amp.dtype='fp8' is not allowed"):
        AmpConfig.from_yaml(path)


def test_a_custom_init_scale_sets_only_where_a_key_starts():
    """The start of one key, below the recover threshold too; max scale, other keys and the
    other hyper-parameters as configured; recover growth brings it back up to the max."""
    c = AmpConfig(custom_init_scales_log2={2: -9, "nu": 3}, default_max_scale_log2=4,
                  derivative_scaler={"init_scale": 0.5, "recover_growth_interval": 2})
    two, nu, one = (c.derivative_scaler_for(k) for k in ("2", "nu", "1"))
    assert (two.init_scale, two.max_scale, two.recover_threshold) == (2.0**-9, 16.0, 2.0**-6)
    assert (nu.init_scale, one.init_scale) == (8.0, 0.5)  # the key's start wins over derivative_scaler.init_scale
    assert two.recover_growth_interval == one.recover_growth_interval == 2
    scalers = jaxamp.init(None, c, keys=["1", "2"])().derivative
    assert float(scalers["2"].scale) == 2.0**-9 and float(scalers["1"].scale) == 0.5
    state = two.init()
    for _ in range(2 * 3):  # 2^-9 -> 2^-6 in recover mode: one doubling per 2 clean steps
        state = two.update(state, False)
    assert float(state.scale) == 2.0**-6
    # a start at the max scale is allowed; the keys are normalised; the config round-trips
    assert AmpConfig(custom_init_scales_log2={3: 0}).custom_init_scales_log2 == {"3": 0}
    assert AmpConfig(custom_max_scales_log2={2: -9}, custom_init_scales_log2={2: -9}).derivative_scaler_for(
        "2").init_scale == 2.0**-9
    assert AmpConfig.from_dict(c.to_dict()) == c and c.to_dict()["custom_init_scales_log2"] == {"2": -9, "nu": 3}

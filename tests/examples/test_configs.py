"""Example configs: variants, modes, overrides, and bad configs rejected before training."""

import pytest

import jaxamp
from examples.burgers import Burgers
from examples.common.config import MODES, ConfigError, amp_settings, load_config
from examples.ldc import LDC


def test_gpu_config_is_modulus_ldc():
    cfg = load_config("ldc", checks=LDC.checks)
    assert (cfg["model"]["layer_size"], cfg["model"]["nr_layers"], cfg["model"]["activation"]) == (512, 6, "silu")
    assert cfg["batch"] == {"top_wall": 1000, "no_slip": 1000, "interior": 4000}
    assert cfg["optimizer"]["lr"] == 1e-3 and cfg["optimizer"]["decay_steps"] == 4000
    assert cfg["training"]["max_steps"] == 10000
    assert cfg["problem"]["box"] == 0.1 and cfg["problem"]["nu"] == 0.01


def test_variant_overrides_its_base_and_cli_overrides_both():
    cpu = load_config("ldc_cpu", checks=LDC.checks)
    assert cpu["model"]["layer_size"] == 128 and cpu["optimizer"]["lr"] == 1e-3  # inherited
    demo = load_config("ldc_demo", ["training.max_steps=7", "amp.dtype=bfloat16", "mode=custom"], checks=LDC.checks)
    assert demo["problem"]["box"] == 0.05 and demo["optimizer"]["lr"] == 3e-3 and demo["model"]["layer_size"] == 128
    assert demo["training"]["max_steps"] == 7 and demo["amp"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("mode", list(MODES))
def test_modes_set_amp(mode):
    amp, scaled = amp_settings(load_config("burgers", [f"mode={mode}"], checks=Burgers.checks))
    assert scaled == mode.startswith("fp16_scaler")
    assert amp.compute_dtype.name == {"fp32": "float32", "bf16": "bfloat16"}.get(mode, "float16")
    if mode != "fp32":
        assert amp.autocast_firstlayer and amp.autocast_activation  # every layer reduced
    if mode == "fp16_scaler_per_term":
        assert amp.mode == "per_term_scaler"


def test_cli_amp_key_beats_mode_preset():
    amp, _ = amp_settings(load_config("burgers", ["mode=fp16_plain", "amp.autocast_firstlayer=false"]))
    assert amp.dtype == "float16" and not amp.autocast_firstlayer


@pytest.mark.parametrize(
    "override, words",
    [
        (["training.max_stepz=5"], ["training.max_stepz", "unknown key", "max_steps"]),
        (["optimizer.lr=fast"], ["optimizer.lr", "'fast'", "a number"]),
        (["training.max_steps=0"], ["training.max_steps=0", "integer >= 1"]),
        (["optimizer.decay_rate=1.5"], ["optimizer.decay_rate=1.5", "(0, 1]"]),
        (["model.activation=relu6"], ["model.activation", "relu6", "silu"]),
        (["mode=fp8"], ["mode='fp8'", "fp16_plain"]),
        (["problem.nu=-1.0"], ["problem.nu=-1.0", "> 0"]),
        (["batch.interior=2.5"], ["batch.interior=2.5", "integer"]),
        (["model.frequencies=[axis]"], ["model.frequencies", "frequency spec"]),
        (["amp.derivative_scaling=maybe"], ["amp.derivative_scaling", "true or false"]),
        (["training.max_steps"], ["key=value"]),
    ],
)
def test_bad_configs_name_key_value_and_allowed(override, words):
    with pytest.raises(jaxamp.ConfigError) as e:
        load_config("burgers", override, checks=Burgers.checks)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_amp_keys_rejected_by_ampconfig():
    with pytest.raises(jaxamp.ConfigError, match="float64"):
        load_config("burgers", ["mode=custom", "amp.dtype=float64"])
    with pytest.raises(jaxamp.ConfigError, match="unknown key"):
        load_config("burgers", ["amp.autocast_everything=true"])


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_problem")


def test_cli_exits_with_message_before_training(tmp_path, capsys):
    from examples.common.main import main

    assert main(Burgers, ["--workdir", str(tmp_path / "w"), "training.max_steps=-3"]) == 2
    assert "training.max_steps=-3" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()

"""How a profile reads: format_profile's table and legend, profile.png's colors, the CLI's --help."""

import re

import numpy as np
import pytest

from jaxamp._src.core.window import LEGEND, PERCENTILES, Profile, format_profile, value_range

COLUMNS = ("log2 max", "p1", "p50", "p99", "<normal", ">max", "up", "down")


def _profile(**groups):
    """A concrete Profile: ``key_<k>=values`` / ``derivative_<name>=values`` / ``hidden_<name>=values``."""
    out = {"keys": {}, "derivatives": {}, "hidden": {}}
    for name, values in groups.items():
        group, key = name.split("_", 1)
        out[{"key": "keys", "derivative": "derivatives",
             "hidden": "hidden"}[group]][key] = value_range(np.asarray(values, np.float32))
    return Profile(**out)


def test_the_legend_explains_every_column_in_the_table_the_docstring_and_the_help(capsys):
    assert PERCENTILES == (1.0, 50.0, 99.0)  # the legend's p1/p50/p99
    header = format_profile(_profile(key_1=[1.0, 2.0]), legend=False).splitlines()[0]
    assert re.findall(r"\S+(?: max)?", header)[1:] == list(COLUMNS)
    for column in COLUMNS:
        assert re.search(rf"^ +{re.escape(column)}\b|^ +\S.* {re.escape(column)}\b", LEGEND, re.M), column
    for fact in ("2^-14", "65504", "percentiles of the nonzero magnitudes", "fraction", "negative", "powers of two"):
        assert fact in LEGEND, fact
    table = format_profile(_profile(key_1=[1.0, 2.0]))
    assert table.endswith(LEGEND) and LEGEND not in format_profile(_profile(key_1=[1.0]), legend=False)
    assert all(line in format_profile.__doc__ for line in LEGEND.splitlines())

    from examples import profile as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "legend printed below it" in out  # the tables carry the legend (checked above)


def test_a_group_without_nonzero_values_reads_all_zero_not_inf():
    prof = _profile(key_1=[0.0, 0.0], key_2=[3.0, 0.5], derivative_u__x=[0.0], hidden_empty=np.zeros((0,)))
    table = format_profile(prof, legend=False)
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines()[1:]}
    assert "inf" not in table.lower() and "nan" not in table.lower()
    for name in ("key 1", "derivative u__x", "hidden empty"):
        assert rows[name].split(name, 1)[1].strip() == "all zero / no values", rows[name]
    # a row with values: its numbers, log2 max 1.6 (log2 3), 16 - 1.6 powers of two up
    numbers = [float(v) for v in rows["key 2"].split("key 2", 1)[1].split()]
    np.testing.assert_allclose(numbers, [1.6, -1.0, 0.3, 1.6, 0.0, 0.0, 14.4, 13.0], atol=0.051)


def test_values_outside_the_window_give_negative_headroom_and_fractions():
    prof = _profile(key_2=[1e5, 1.0, 2.0**-20])
    numbers = [float(v) for v in format_profile(prof, legend=False).splitlines()[1].split()[2:]]
    log2_max, frac_sub, frac_over, up, down = numbers[0], numbers[4], numbers[5], numbers[6], numbers[7]
    assert log2_max == pytest.approx(np.log2(1e5), abs=0.05) and up < 0 and down < 0
    assert frac_sub == pytest.approx(1 / 3, abs=1e-3) and frac_over == pytest.approx(1 / 3, abs=1e-3)


def test_an_empty_profile_says_so():
    table = format_profile(Profile(derivatives={}, hidden={}, keys={}), legend=False)
    assert "no scaled values" in table and "inf" not in table


def test_profile_png_red_means_the_drawn_bar_leaves_the_band(tmp_path):
    from examples.common.plots import PROFILE_COLORS, plot_profile, profile_color

    rng = np.random.default_rng(0)
    inside = rng.uniform(1.0, 100.0, 1000)
    few_tiny = np.concatenate([inside, [1e-6]])  # 1 in 1001 below 2^-14: p1 still inside the band
    cases = {"inside": inside, "few_tiny": few_tiny, "over": np.concatenate([inside, [1e5]]),
             "under": np.concatenate([inside, np.full(50, 1e-6)]), "zero": np.zeros(4)}
    prof = _profile(**{f"derivative_{k}": v for k, v in cases.items()})
    colors = {k: profile_color(r) for k, r in prof.derivatives.items() if k != "zero"}
    assert colors == {"inside": "C0", "few_tiny": "C1", "over": "C3", "under": "C3"}
    for name, r in prof.derivatives.items():  # red exactly when the bar (p1 to max) crosses an edge
        if name != "zero":
            lo, hi = float(r.log2_percentiles[0]), float(r.log2_max)
            assert (colors[name] == "C3") == (hi > np.log2(65504.0) or lo < -14), name
    assert float(prof.derivatives["few_tiny"].frac_subnormal) > 0 > -float(prof.derivatives["few_tiny"].headroom_down)
    assert [c for c, _ in PROFILE_COLORS] == ["C3", "C1", "C0"]
    path = plot_profile(str(tmp_path), prof)
    assert path.endswith("profile.png") and (tmp_path / "profile.png").stat().st_size > 0

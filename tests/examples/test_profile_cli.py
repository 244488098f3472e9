"""python -m examples.profile: the range table of an example config and its amp: block."""

import pytest

from examples import profile as cli
from examples.burgers import Burgers
from tests.helpers.examples import COMMON, TINY


@pytest.mark.slow  # compiles the profile and a 2-step chunk of an example
def test_profile_prints_the_table_and_a_recommendation(capsys):
    # Scales that start far too high: the table shows keys above 65504, the block lowers them.
    args = ["--config", "burgers", "--steps", "2", *COMMON, *TINY[Burgers], "amp.default_max_scale_log2=30",
            "amp.derivative_scaler.init_scale=1073741824.0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "# burgers: step 0" in out and "# burgers: step 2" in out
    for row in ("key 1", "key 2", "derivative 1", "derivative 2", "hidden 1", "hidden 2"):
        assert row in out
    block = out.split("# recommended")[1]
    assert "amp:" in block and '"1": ' in block and '"2": ' in block


def test_profile_rejects_a_bad_config(capsys):
    assert cli.main(["--config", "burgers", "amp.dtype=float64"]) == 2
    assert "amp.dtype" in capsys.readouterr().err

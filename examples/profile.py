"""Where an example's derivatives sit in float16's window, and the scales that fit them.

``python -m examples.profile --config burgers [--steps N] [--margin M] [key=value ...]``
prints the table of ``jaxamp.profile``'s result (its ``format()``) for the config's network at
initialization (and after ``N`` training steps) with its legend, then the recommended
``amp:`` block of start scales (the profile's ``recommend()``, measured at scale 1;
``custom_init_scales_log2``: where each key starts, its max scale unchanged) to paste into
the config, or a comment saying that nothing needs to change.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence, Type

import jax
import jax.numpy as jnp

import jaxamp
from examples.common.config import load_config
from examples.common.problem import Problem
from examples.common.train import get_setup


def problem_class(name: str) -> Type[Problem]:
    """The example problem called ``name`` (its module ``examples.<name>``)."""
    module = importlib.import_module(f"examples.{name}")
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Problem) and value is not Problem and value.name == name:
            return value
    raise jaxamp.ConfigError(f"name={name!r} is not allowed: expected an example problem (examples/<name>.py).")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.profile", description=__doc__.split("\n\n")[0],
                                     epilog="each table's columns are explained in the legend printed below it")
    parser.add_argument("--config", required=True, help="config name in examples/configs or a YAML path")
    parser.add_argument("--steps", type=int, default=0, help="also profile after this many training steps")
    parser.add_argument("--margin", type=int, default=2, help="powers of two kept free below 65504")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"--steps={args.steps} is not allowed: expected an integer >= 0")
    try:
        name = load_config(args.config, args.overrides)["name"]
        cls = problem_class(name)
        setup = get_setup(cls, load_config(args.config, args.overrides, checks=cls.checks))
    except jaxamp.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    state = setup.init_state()
    print(f"# {name}: step 0\n{setup.profile(state)[0].format(legend=not args.steps)}")
    if args.steps:  # the legend once, below the last table
        monitor = setup.monitor(0)
        (state, _), _ = setup.chunk(args.steps, 0)((state, monitor.init()))
        print(f"\n# {name}: step {int(state.step)}\n{setup.profile(state)[0].format()}")
    parts = setup.problem.sample(jax.random.fold_in(setup.sample_key, state.step)).values()
    points = {n: jnp.concatenate([part[n] for part in parts]) for n in setup.problem.inputs}
    if setup.engines[0].scaler_keys:
        prof = jax.jit(jaxamp.profile(setup.engines[0]))(None, state.params, points)
        rec = prof.recommend(margin_log2=args.margin, default_max_scale_log2=setup.amp.default_max_scale_log2)
        print(f"\n# recommended start scales (margin 2^{args.margin} below 65504; max scales unchanged):\n"
              f"{rec.to_yaml()}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

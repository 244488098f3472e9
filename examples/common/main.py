"""Command line of the examples: ``python -m examples.<problem> [--config C] [--workdir W]
[--resume] [key=value ...]``.

Exit status: 0 done, 2 bad config (nothing trained), 3 stopped early because the run stalled
(``training.max_consecutive_skips`` skipped steps in a row; the reason is printed). After the
summary it prints where the outputs went and ends with a one-line verdict (trained, or stalled
and why: :mod:`examples.common.verdict`), whatever the exit status."""

from __future__ import annotations

import jaxamp

import argparse
import json
import sys
from typing import Optional, Sequence, Type

from examples.common.config import load_config
from examples.common.problem import Problem
from examples.common.verdict import outputs_line, run_verdict


def main(problem_cls: Type[Problem], argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m examples.{problem_cls.name}",
        description=f"Train the {problem_cls.name} PINN. Overrides are omegaconf dotlist entries, "
        "e.g. mode=fp16_plain amp.dtype=bfloat16 training.max_steps=200.",
    )
    default = problem_cls.default_config or problem_cls.name
    parser.add_argument("--config", default=default,
                        help=f"config name in examples/configs or a YAML path (default: {default}, sized for a CPU)")
    parser.add_argument("--workdir", default=None, help="output folder (default runs/<problem>_<mode>)")
    parser.add_argument("--resume", action="store_true", help="continue from the workdir's last checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    from examples.common.train import train_and_evaluate

    try:
        cfg = load_config(args.config, args.overrides, checks=problem_cls.checks)
        workdir = args.workdir or f"runs/{problem_cls.name}_{cfg['mode']}"
        summary = train_and_evaluate(problem_cls, cfg, workdir, resume=args.resume, progress=not args.no_progress)
    except jaxamp.ConfigError as e:  # the examples' and AmpConfig's config errors
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    print(outputs_line(workdir))
    print(run_verdict(workdir, summary))
    return 0 if summary["stalled"] is None else 3

"""Run klrl from the command line: ``python experiments/run.py [--section.field value ...]``.

With no arguments: the default experiment on the built-in task, offline, on CPU.
``--help`` lists every configuration field with its meaning and default.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    from klrl.cli import build_parser, config_from_args, fail
    from klrl.config import ConfigError

    parser = build_parser("PPO with a KL penalty; beta lives in the train state.")
    ns = parser.parse_args(argv)
    cfg = config_from_args(ns)

    import klrl

    try:
        result = klrl.run(cfg)
    except ConfigError as e:
        fail(str(e))
    s = result.summary()
    print(f"run directory: {result.dir}")
    print(f"{'metric':<22}{'start':>12}{'end':>12}")
    for k, v in s.items():
        print(f"{k:<22}{v['start']:>12.4g}{v['end']:>12.4g}")
    print(f"train time {result.info['train_s']:.1f}s for {cfg.train.iterations} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

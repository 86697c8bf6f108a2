"""Run klrl from the command line: ``python experiments/run.py [--section.field value ...]``.

``klrl study`` and its sibling commands (``klrl train | sweep | study | resume | report``, also
``python -m klrl``): :func:`klrl.cli.legacy_main` parses these flags once, picks the command they ask
for (no flags or ``--study`` -> ``klrl study``, ``--sweep`` -> ``klrl sweep``, ``--resume`` -> ``klrl
resume``, ``--report`` -> ``klrl report``, configuration flags alone -> ``klrl train``) and runs it.

With no configuration flags (or with ``--study`` plus overrides): the default experiment, a short beta study
on the testbed, offline, on CPU: fixed beta in {0.01, 0.1, 1.0} and one proportional controller
(target 3 nats/sequence), run as one compiled sweep, then a table with each run's diagnosis.
With configuration flags (or ``--config FILE``, JSON or YAML, e.g. a run's ``config.json``) and no
``--study``/``--sweep``: one training run. ``--help`` lists every configuration field with its meaning
and default.

``--resume RUN_DIR [--train.iterations N ...]`` continues a run from its latest complete
checkpoint (only train.iterations and the logging/checkpoint/rollback knobs may change);
``--resume SWEEP_DIR`` continues a sweep the same way (every member, bit for bit).
Exit status: 0 done (or stopped by SIGTERM after a checkpoint), 130 stopped by SIGINT after a
checkpoint (a second SIGINT: at once, the last complete checkpoint intact), 1 the run stopped itself
(non-finite guard, rollback limit), 2 bad input or a problem of the run's environment: a missing,
damaged (checksum) or foreign checkpoint, a run directory another process is writing (locked), a
full disk (the last complete checkpoint is intact: continue it with --resume on another disk).

``--sweep kl.beta=0.001,0.01,0.1,1.0 [--sweep train.seed=0,1] [--sweep-devices K]`` runs the
Cartesian grid of the axes as one compiled program (:func:`klrl.sweep`, members split over K
device groups) and prints one summary table. ``--distributed [--coordinator HOST:PORT
--num-processes N --process-id I]`` joins a multi-process run first (:mod:`klrl.distributed`;
no arguments needed on Cloud TPU or Slurm); see docs/launch.md.

``--report RUN_DIR`` (alone) writes ``report.md`` (config, summary, diagnosis timeline, PNG plots) into
a run or sweep directory, prints its path and exits (:func:`klrl.analysis.report.write_report`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path (python experiments/NAME.py): the repo root, for klrl uninstalled
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from klrl.cli import legacy_main

    return legacy_main(argv)


if __name__ == "__main__":
    sys.exit(main())

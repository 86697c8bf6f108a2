"""``python tests/phase_driver.py PHASE [run.py arguments]``: ``experiments/run.py`` with a marker.

When the run reaches ``PHASE`` the process prints ``PHASE-REACHED`` on stderr, so a test can send
a signal at that moment (then it pauses ``KLRL_PHASE_PAUSE`` seconds, default 0, to hold the run
in that phase while the signal arrives; ``KLRL_SLOW_EXIT`` seconds hold every run's way out, as a
slow JAX/orbax teardown would). Phases:

* ``build``: the task build (pretraining) starts;
* ``init``: the run directory exists and holds config.json (the train state is built next);
* ``compile``: the first ``train.step`` call (which compiles) starts;
* ``iterations``: the second metrics line is written;
* ``checkpoint``: a checkpoint write was started (orbax writes it in the background);
* ``exit``: the loop has ended and the last checkpoint is being finished (the way out).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASE = sys.argv[1]
PAUSE = float(os.environ.get("KLRL_PHASE_PAUSE", "0"))
SLOW_EXIT = float(os.environ.get("KLRL_SLOW_EXIT", "0"))


def mark(name: str) -> None:
    if name == PHASE:
        print("PHASE-REACHED", file=sys.stderr, flush=True)
        if PAUSE:
            time.sleep(PAUSE)


def main() -> None:
    import klrl.loop.build as runner
    import klrl.step.train as train_mod
    from klrl.io import checkpoint as ckpt
    from klrl.io import logging as io_logging

    build_task, make_train, save, finish = runner.build_task, train_mod.make_train, ckpt.save, ckpt.finish
    write, init = io_logging.MetricsWriter.write, io_logging.MetricsWriter.__init__

    def build_task_(*a, **k):
        mark("build")
        return build_task(*a, **k)

    def make_train_(*a, **k):
        t = make_train(*a, **k)
        step, calls = t.step, [0]

        def step_(*sa, **sk):
            calls[0] += 1
            if calls[0] == 1:
                mark("compile")
            return step(*sa, **sk)

        return t._replace(step=step_)

    def init_(self, *a, **k):
        init(self, *a, **k)
        mark("init")

    def write_(self, iteration, metrics):
        write(self, iteration, metrics)
        if sum(1 for _ in open(self.path)) == 2:
            mark("iterations")

    def save_(*a, **k):
        save(*a, **k)
        mark("checkpoint")

    def finish_(*a, **k):
        mark("exit")
        time.sleep(SLOW_EXIT)
        return finish(*a, **k)

    runner.build_task, train_mod.make_train, ckpt.save, ckpt.finish = build_task_, make_train_, save_, finish_
    runner.make_train = make_train_  # (runner imports it by name)
    io_logging.MetricsWriter.write, io_logging.MetricsWriter.__init__ = write_, init_
    sys.argv = [str(ROOT / "experiments" / "run.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

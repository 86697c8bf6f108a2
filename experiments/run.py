"""Run klrl from the command line: ``python experiments/run.py [--section.field value ...]``.

With no configuration flags (or with ``--study`` plus overrides): the default experiment, a short beta study
on the testbed, offline, on CPU: fixed beta in {0.01, 0.1, 1.0} and one proportional controller
(target 3 nats/sequence), run as one compiled sweep, then a table with each run's diagnosis.
With configuration flags and no ``--study``/``--sweep``: one training run.
``--help`` lists every configuration field with its meaning and default.

``--resume RUN_DIR [--train.iterations N ...]`` continues a run from its latest complete
checkpoint (only train.iterations and the logging/checkpoint/rollback knobs may change);
``--resume SWEEP_DIR`` continues a sweep the same way (every member, bit for bit).
Exit status: 0 done (or stopped by SIGTERM after a checkpoint), 130 stopped by SIGINT after a
checkpoint, 1 the run stopped itself (non-finite guard, rollback limit), 2 bad input.

``--sweep kl.beta=0.001,0.01,0.1,1.0 [--sweep train.seed=0,1] [--sweep-devices K]`` runs the
Cartesian grid of the axes as one compiled program (:mod:`klrl.sweep`, members split over K
device groups) and prints one summary table. ``--distributed [--coordinator HOST:PORT
--num-processes N --process-id I]`` joins a multi-process run first (:mod:`klrl.distributed`;
no arguments needed on Cloud TPU or Slurm); see docs/launch.md.

``--report RUN_DIR`` writes ``report.md`` (config, summary, diagnosis timeline, PNG plots) into a run
or sweep directory, prints its path and exits (:func:`klrl.report.write_report`).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    from klrl.cli import build_parser, config_from_args, fail
    from klrl.config import ConfigError, RunConfig

    def resume_arg(p):
        p.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue this run from its latest complete checkpoint")  # fmt: skip
        p.add_argument("--report", metavar="RUN_DIR", default=None,
                       help="write report.md (summary, diagnosis, plots) for this run or sweep directory "
                            "and exit; trains nothing")  # fmt: skip

    def scale_args(p):
        resume_arg(p)
        p.add_argument("--sweep", metavar="SECTION.FIELD=V1,V2,...", action="append", default=[],
                       help="a sweep axis (repeatable: the grid is their Cartesian product), run as one "
                            "compiled program")  # fmt: skip
        p.add_argument("--sweep-devices", metavar="K", type=int, default=1,
                       help="device groups the sweep members are split over (the rest of the devices "
                            "split each member's batch)")  # fmt: skip
        p.add_argument("--quiet", action="store_true", help="print only the summary (= --train.quiet true)")
        p.add_argument("--study", action="store_true",
                       help="the default beta study (what running with no arguments does), with any "
                            "overrides applied to every member")  # fmt: skip
        p.add_argument("--distributed", action="store_true",
                       help="join a multi-process run (jax.distributed) before anything else; "
                            "auto-detected on Cloud TPU, Slurm, ...")  # fmt: skip
        p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="--distributed: process 0's address ($KLRL_COORDINATOR)")  # fmt: skip
        p.add_argument("--num-processes", metavar="N", type=int, default=None,
                       help="--distributed: process count ($KLRL_NUM_PROCESSES)")  # fmt: skip
        p.add_argument("--process-id", metavar="I", type=int, default=None,
                       help="--distributed: this process's index ($KLRL_PROCESS_ID)")  # fmt: skip

    parser = build_parser("PPO with a KL penalty; beta lives in the train state.", extra=scale_args)
    argv = sys.argv[1:] if argv is None else argv
    ns = parser.parse_args(argv)
    overrides = [a for a in argv if a.startswith("--") and "." in a.split("=")[0]]
    study = ns.study or (not overrides and ns.resume is None)
    if ns.report is not None:
        from klrl.report import ReportError, write_report

        try:
            print(write_report(ns.report))
        except ReportError as e:
            fail(f"--report: {e}")
        return 0
    base = None
    resume_sweep = ns.resume is not None and os.path.isfile(os.path.join(ns.resume, "sweep.json"))
    if resume_sweep:  # a sweep directory: its members' configs, with the overrides applied to each
        from klrl.results import load_sweep

        if ns.sweep or ns.study:
            fail("--resume: a sweep resumes with its own members; drop --sweep/--study")
        try:
            saved = [r.config for r in load_sweep(ns.resume)]
        except (OSError, ValueError, TypeError, KeyError) as e:
            fail(f"--resume: {ns.resume} is not a readable klrl sweep directory: {e}")
        members = [config_from_args(ns, base=m) for m in saved]
        if ns.quiet:
            members = [m.replace(train={"quiet": True}) for m in members]
        return _sweep(members, [], ns, resume=ns.resume)
    if ns.resume is not None:
        path = os.path.join(ns.resume, "config.json")
        if not os.path.isfile(path):
            fail(f"--resume: {ns.resume} is not a klrl run directory (no config.json or sweep.json)")
        try:
            with open(path) as f:
                base = RunConfig.from_dict(json.load(f))
        except (ValueError, TypeError) as e:
            fail(f"--resume: {path} is not a valid klrl config: {e}")
    cfg = config_from_args(ns, base=base)
    if ns.quiet:
        cfg = cfg.replace(train={"quiet": True})
    from klrl.config import config_warnings

    for w in config_warnings(cfg):
        print(f"warning: {w}", file=sys.stderr)
    members = None
    if study and not ns.sweep:
        if ns.resume is not None:
            fail("--study: cannot be combined with --resume")
        axes = {"kl.beta": None, "ctrl.kind": None}
        if not overrides:  # the built-in default: short enough for a laptop CPU in a few minutes
            cfg = cfg.replace(train={"iterations": 100, "name": cfg.train.name or "beta-study"})
        try:
            members = [cfg.replace(kl={"beta": b}, ctrl={"kind": "fixed"}) for b in (0.01, 0.1, 1.0)]
            adaptive = {"kind": "proportional", "target": 3.0, "unit": "seq_sum", "horizon": 1000.0}
            members.append(cfg.replace(kl={"beta": 0.1}, ctrl=adaptive))
        except ConfigError as e:
            fail(str(e))
    elif ns.sweep:
        from klrl.sweep import check_members, grid, parse_axis

        if ns.resume is not None:
            fail("--sweep: cannot be combined with --resume")
        try:
            axes = dict(parse_axis(spec, cfg) for spec in ns.sweep)
            if len(axes) != len(ns.sweep):
                fail("--sweep: the same field is given twice")
            members = grid(cfg, axes)
            check_members(members)
        except ConfigError as e:
            fail(str(e))
    elif ns.sweep_devices != 1:
        fail("--sweep-devices: needs --sweep")
    if ns.sweep_devices < 1:
        fail(f"--sweep-devices: must be >= 1 (got {ns.sweep_devices})")
    if ns.distributed or ns.coordinator or ns.num_processes is not None or ns.process_id is not None:
        from klrl.distributed import initialize

        try:  # before anything touches a device
            initialize(ns.coordinator, ns.num_processes, ns.process_id)
        except ValueError as e:
            fail(f"--distributed: {e}")

    if members is not None:
        return _sweep(members, list(axes), ns)

    import klrl
    from klrl.io.checkpoint import CheckpointError
    from klrl.reliability import RunStopped

    try:
        from klrl.report import maybe_write_report

        result = klrl.run(cfg, resume=ns.resume, report=maybe_write_report)
    except (ConfigError, CheckpointError) as e:
        fail(str(e))
    except RunStopped as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from klrl.distributed import is_main

    stopped = result.info.get("stopped")
    if is_main():  # several processes (--distributed): one summary, from the process that writes
        s = result.summary()
        print(f"run directory: {result.dir}")
        print(f"{'metric':<22}{'start':>12}{'end':>12}")
        for k, v in s.items():
            print(f"{k:<22}{v['start']:>12.4g}{v['end']:>12.4g}")
        done = result.info["iteration"] - result.info["start_iteration"]
        print(f"train time {result.info['train_s']:.1f}s for {done} iterations")
        if stopped:
            print(f"stopped by {stopped} at iteration {result.info['iteration']} (checkpoint saved); "
                  f"continue with: python experiments/run.py --resume {result.dir}")  # fmt: skip
    if stopped:
        return 130 if stopped == "SIGINT" else 0
    return 0


def _sweep(members, axes, ns, resume=None) -> int:
    """Run (or resume) a sweep; the summary table, exit status as for a single run."""
    import jax

    from klrl.cli import fail
    from klrl.config import ConfigError
    from klrl.io.checkpoint import CheckpointError
    from klrl.reliability import RunStopped
    from klrl.report import maybe_write_report
    from klrl.sweep import summary_table, sweep

    try:
        results = sweep(members, sweep_devices=ns.sweep_devices, resume=resume, report=maybe_write_report)
    except (ConfigError, CheckpointError) as e:
        fail(str(e))
    except RunStopped as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    stopped = results[0].info.get("stopped")
    root = results[0].dir.parent if results[0].dir is not None else None
    if jax.process_index() == 0:
        from klrl.diagnosis import final_regime

        print(summary_table(results, axes))
        for i, r in enumerate(results):
            print(f"member {i:02d}: diagnosis {final_regime(r.metrics, r.config.diag)}")
        if root is not None:
            print(f"sweep directory: {root}")
        done = results[0].info["iteration"] - results[0].info["start_iteration"]
        print(f"train time {results[0].info['train_s']:.1f}s for {len(members)} members x {done} iterations")
        if stopped:
            print(f"stopped by {stopped} at iteration {results[0].info['iteration']} (checkpoint saved); "
                  f"continue with: python experiments/run.py --resume {root}")  # fmt: skip
    if stopped:
        return 130 if stopped == "SIGINT" else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

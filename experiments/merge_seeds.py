"""Add the seeds of a finished sweep to a stored study, as one sweep directory with a seed axis.

``python experiments/merge_seeds.py --into experiments/results/beta_grid --source runs/fixed-seeds12``
``python experiments/merge_seeds.py --into experiments/results/overoptimization --source runs/fixed-seeds12
--iterations 400``

Every member of ``--source`` whose setting (its config up to ``train.seed`` and the fields that only
name a run, :func:`klrl.analysis.aggregate.setting_key`) is one of ``--into``'s settings is copied into
``--into`` (``config.json`` and ``metrics.jsonl`` gzipped, as the stored results are; no checkpoints,
no event files); members of other settings are left out and listed (e.g. the target-6 members of an
adaptive sweep merged into the target-3 study). A member whose (setting, seed) is already stored is
refused, as is a source whose task (``task.json``) differs from the stored one. ``--iterations N``
keeps the first N iterations of each source member (its config says ``train.iterations = N``): a
longer run's first N iterations are the run of N iterations (nothing in a step depends on the total;
a constant learning-rate schedule), so one 500-iteration sweep serves a 400-iteration study. Then every member
directory is named after its swept values (:func:`klrl.analysis.results.member_names`, e.g.
``kl.beta=0.1,train.seed=1``) and ``sweep.json`` lists them with their axes, ordered by setting
(in the stored order) then seed. ``--replay`` of the study script re-tabulates the merged directory.
A user's mistake is one line on stderr and exit status 2; nothing is written before every check passed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

if not __package__:  # run by path (python experiments/NAME.py): the repo root, for klrl uninstalled
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from klrl.analysis.aggregate import NOT_SETTING, setting_key  # noqa: E402
from klrl.analysis.results import load_run, member_names, sweep_axes  # noqa: E402
from klrl.cli.args import fail  # noqa: E402
from klrl.io.readers import RunDirError, read_sweep_members  # noqa: E402


def _metrics_file(d: Path) -> Path:
    for name in ("metrics.jsonl.gz", "metrics.jsonl"):
        if (d / name).is_file():
            return d / name
    fail(f"{d}: no metrics.jsonl(.gz)")


def _load(root: Path, iterations: int | None = None) -> list[tuple[Path, object]]:
    try:
        out = [(root / n, load_run(root / n).config) for n in read_sweep_members(root)]
    except (RunDirError, OSError, ValueError) as e:
        fail(f"{root}: {e}")
    if iterations is None:
        return out
    for d, c in out:
        if c.train.iterations < iterations:
            fail(f"--iterations {iterations}: {d} ran {c.train.iterations} iterations")
        if c.optim.schedule != "constant":
            fail(f"--iterations: {d} has optim.schedule {c.optim.schedule!r}, its steps depend on the total")
    return [(d, c.replace(train={"iterations": iterations})) for d, c in out]


def _lines(src: Path, iterations: int | None) -> bytes:
    """The metrics file's bytes, its rows cut to ``iteration < iterations``."""
    raw = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
    if iterations is None:
        return raw
    keep = [
        ln for ln in raw.splitlines(keepends=True) if ln.strip() and json.loads(ln)["iteration"] < iterations
    ]
    if len(keep) != iterations:
        fail(f"{src}: {len(keep)} rows below iteration {iterations}, expected {iterations}")
    return b"".join(keep)


def plan(
    into: Path, source: Path, iterations: int | None = None
) -> tuple[list[tuple[Path, object]], list[str]]:
    """``([(member dir, config)] in the merged order, [left-out source members])``; checks only."""
    for d in (into, source):
        if not d.is_dir():
            fail(f"{d}: not a directory")
    t_into, t_src = into / "task.json", source / "task.json"
    if (
        t_into.is_file()
        and t_src.is_file()
        and json.loads(t_into.read_text()) != json.loads(t_src.read_text())
    ):
        fail(f"{source}/task.json differs from {into}/task.json: not the same task")
    stored, new = _load(into), _load(source, iterations)
    order = list(dict.fromkeys(setting_key(c) for _, c in stored))
    have = {(setting_key(c), c.train.seed) for _, c in stored}
    added, left = [], []
    for d, c in new:
        key = (setting_key(c), c.train.seed)
        if key[0] not in order:
            left.append(d.name)
        elif key in have:
            fail(f"{d}: setting with train.seed={c.train.seed} is already in {into}")
        else:
            have.add(key)
            added.append((d, c))
    if not added:
        fail(f"{source}: no member has one of {into}'s settings")
    both = stored + added
    both.sort(key=lambda dc: (order.index(setting_key(dc[1])), dc[1].train.seed))
    return both, left


def _named_by_setting(configs: list) -> list:
    """The configs with the fields that name no setting (:data:`klrl.analysis.aggregate.NOT_SETTING`: run
    name, output directory, cache directory) set to the first one's, so that names carry only the
    swept values."""
    first = configs[0]
    upd: dict[str, dict] = {}
    for dotted in NOT_SETTING:
        section, field = dotted.split(".", 1)
        upd.setdefault(section, {})[field] = getattr(getattr(first, section), field)
    return [c.replace(**upd) for c in configs]


def merge(into: Path, source: Path, iterations: int | None = None) -> list[str]:
    both, left = plan(into, source, iterations)
    configs = [c for _, c in both]
    names = member_names(_named_by_setting(configs))
    tmp = into / ".merge"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for (d, c), name in zip(both, names, strict=True):
        dst = tmp / name
        dst.mkdir()
        (dst / "config.json").write_text(json.dumps(c.to_dict(), indent=1))
        src = _metrics_file(d)
        if src.suffix == ".gz" and (d.parent == into or iterations is None):
            shutil.copyfile(src, dst / "metrics.jsonl.gz")  # stored members: byte for byte
        else:
            cut = iterations if d.parent != into else None
            (dst / "metrics.jsonl.gz").write_bytes(gzip.compress(_lines(src, cut), compresslevel=9, mtime=0))
    # swap in: old member directories out, merged ones in, then the index
    for d, _ in both:
        if d.parent == into:
            shutil.rmtree(d)
    for name in names:
        (tmp / name).rename(into / name)
    tmp.rmdir()
    index = {"members": names, "axes": sweep_axes(_named_by_setting(configs))}
    (into / "sweep.json").write_text(json.dumps(index, indent=1, default=str))
    return left


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--into", required=True, help="the stored study's sweep directory")
    p.add_argument("--source", required=True, help="a finished sweep with more seeds of its settings")
    p.add_argument("--iterations", type=int, default=None, help="keep the source's first N iterations")
    ns = p.parse_args(argv)
    into, source = Path(ns.into), Path(ns.source)
    if ns.iterations is not None and ns.iterations < 1:
        fail(f"--iterations: must be >= 1, got {ns.iterations}")
    left = merge(into, source, ns.iterations)
    print(f"merged into {into}: {len(read_sweep_members(into))} members")
    if left:
        print(f"left out ({len(left)}, other settings): {', '.join(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

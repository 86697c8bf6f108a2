"""``report.md`` for a run or a sweep: config, start/end summary, diagnosis timeline, PNG plots.

``write_report(RUN_DIR)`` (or a :class:`~klrl.analysis.results.RunResult`, or the list a sweep returns)
writes ``report.md`` and ``report-<plot>.png`` files beside it, in the run directory; for a sweep
directory (``sweep.json``) one report covers all members: a row per setting (members equal up to
``train.seed``; final values as mean ± 95% t-interval over seeds) and a row per member. The command
line is ``python experiments/run.py --report RUN_DIR``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from klrl.analysis.aggregate import label, seed_groups, t_interval, tail_mean, unit_of
from klrl.analysis.diagnosis import final_regime, timeline
from klrl.analysis.results import RunResult, load_run, load_sweep
from klrl.analysis.summary import cannot_differ_note
from klrl.config.fields import GPT_ONLY
from klrl.io import checkpoint as ckpt
from klrl.io.readers import (
    RunDirError,
    config_diff,
    is_dir,
    read_jsonl,
    read_sweep_members,
    read_task_info,
    what_is,
)
from klrl.io.resume import replace_file
from klrl.io.samples import report_lines
from klrl.registry import is_adaptive

# nothing in klrl imports this module but the command line and the user: the report is attached
# to a finished run by its caller (``klrl.run``'s ``report`` argument, the ``klrl`` command)


REPORT_NAME = "report.md"
# the tables' final value is the plots' last point: the plots are drawn with the report's window
_SAME = "final is the last point of each curve in the plots, drawn as trailing means over the same window"
WINDOW = 10  # iterations: start and final values are means over the first / last (at most) WINDOW


def report_window(n: int, cap: int = WINDOW) -> int:
    """The start/final window of a run of ``n`` iterations: ``cap``, but at most a third of the run (at
    least 1), so the start and final windows never overlap and a short run's start is not its end."""
    return max(1, min(cap, n // 3))


# start/end rows of the summary, in this order, where logged
REPORT_KEYS = (
    "reward/task",
    "reward/proxy",
    "reward/gold",
    "kl/k1_seq_sum",
    "kl/exact_seq_sum",
    "kl/k1_seq_token_mean",
    "ctrl/beta",
    "eval/oracle_ppl_floored",
    "eval/independent_ppl",
    "eval/ref_ppl",
    "eval/distinct_2",
    "response/length",
)


class ReportError(ValueError):
    """The source is not a readable klrl run or sweep directory."""


def _plots_for(results: list[RunResult]) -> list[tuple[str, str]]:
    """``(plot function, title)`` for the figures these results have data for."""
    has = lambda *names: any(n in r.metrics for r in results for n in names)
    kl = has("kl/exact_seq_sum", "kl/k1_seq_sum")
    out = []
    if has("ctrl/beta") or kl:
        out.append(("beta_kl", "beta and KL"))
    if kl and has("reward/proxy", "reward/task", "reward/gold"):
        out.append(("frontier", "reward-KL frontier"))
    if kl and has("reward/gold"):
        out.append(("overoptimization", "overoptimization: gold and proxy against sqrt(KL), Gao et al. fit"))
    ppl = ("eval/oracle_ppl_floored", "eval/independent_ppl", "eval/ref_ppl")
    if has(*ppl, "eval/distinct_1", "eval/distinct_2"):
        out.append(("perplexity_diversity", "perplexity and diversity"))
    if any(is_adaptive(r.config.ctrl.kind) for r in results):
        out.append(("controller_comparison", "controller: KL / target and beta"))
    return out


def _window_of(plot: str, w: int) -> dict[str, int]:
    """The report's window for a plot, so that its curves end on the tables' final values: the trailing
    mean of the beta and KL curves (beta too), the frontier's windows."""
    kw = {"beta_kl": {"smooth": w, "beta_smooth": w}, "frontier": {"window": w}}
    return kw.get(plot, {"smooth": w} if plot in ("perplexity_diversity", "controller_comparison") else {})


# ---- loading -------------------------------------------------------------------------------------
def _metrics_file(d: Path) -> Path:
    """A member's metrics file (``metrics.jsonl``, or the stored results' ``metrics.jsonl.gz``)."""
    p = d / "metrics.jsonl"
    return d / "metrics.jsonl.gz" if not p.exists() and (d / "metrics.jsonl.gz").is_file() else p


def _checkpoint_rows(root: Path) -> tuple[int, int] | None:
    """(step, metrics rows it counts) of the newest complete checkpoint in ``root``, or None."""
    done = ckpt.complete_steps(root)
    if not done:
        return None
    mgr = ckpt.manager(root, read_only=True)
    try:
        return done[-1], int(ckpt.read_meta(mgr, done[-1])["metrics_lines"])
    except (ckpt.CheckpointError, KeyError, TypeError, ValueError):
        return None  # (a damaged checkpoint is resume's and export's to refuse; the rows are still read)
    finally:
        mgr.close()


def check_rows(root: Path, is_sweep: bool) -> str:
    """The metrics rows of a run or sweep directory checked as a resume checks them, before a report
    is written: every member's ``metrics.jsonl`` present, not cut mid-line, with at least the rows
    the newest complete checkpoint counts (:class:`ReportError` otherwise, nothing written); returns
    what was read, in one line."""
    dirs = [root / n for n in read_sweep_members(root)] if is_sweep else [root]
    counts = []
    for d in dirs:
        p = _metrics_file(d)
        if not p.is_file():
            raise ReportError(f"{p}: no such file (the run's rows are missing; nothing written)")
        if p.suffix == ".gz":
            counts.append(len(read_jsonl(p)))
            continue
        n = (data := p.read_bytes()).count(b"\n")
        if data and not data.endswith(b"\n"):
            raise ReportError(f"{p}: cut mid-line after {n} complete rows (nothing written)")
        counts.append(n)
    saved = _checkpoint_rows(root)
    for d, n in zip(dirs, counts, strict=True):
        if saved is not None and n < saved[1]:
            raise ReportError(
                f"{_metrics_file(d)} has {n} rows; checkpoint {saved[0]} in {root} counts "
                f"{saved[1]} (rows are missing; nothing written)"
            )
    rows = f"{counts[0]} rows" if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)} rows"
    who = f"of {len(dirs)} members" if is_sweep else "of 1 run"
    return f"read {rows} {who} from {', '.join(str(_metrics_file(d)) for d in dirs)}"


def _load_dir(path: Path) -> tuple[list[RunResult], Path, bool]:
    if not is_dir(path):
        what = what_is(path)
        raise ReportError(
            f"{path}: no such run directory"
            if what == "no such directory"
            else f"{path}: not a run directory ({what})"
        )
    try:
        read_task_info(path)  # a damaged task.json: one line naming it
    except RunDirError as e:
        raise ReportError(str(e)) from e
    try:
        if (path / "sweep.json").is_file():
            return load_sweep(path), path, True
        if (path / "config.json").is_file():
            return [load_run(path)], path, False
    except (OSError, ValueError, TypeError, KeyError) as e:  # ConfigError and JSONDecodeError included
        raise ReportError(f"{path}: unreadable klrl run ({type(e).__name__}: {e})") from e
    raise ReportError(f"{path}: not a klrl run or sweep directory (no config.json or sweep.json)")


def _resolve(
    source: str | Path | RunResult | Sequence[RunResult], out_dir: str | Path | None
) -> tuple[list[RunResult], Path, bool]:
    if isinstance(source, str | Path):
        results, root, is_sweep = _load_dir(Path(source))
        return results, Path(out_dir) if out_dir is not None else root, is_sweep
    results = [source] if isinstance(source, RunResult) else list(source)
    if not results:
        raise ReportError("write_report: no results")
    if out_dir is not None:
        return results, Path(out_dir), len(results) > 1
    dirs = [r.dir for r in results]
    if any(d is None for d in dirs):
        raise ReportError("write_report: a result has no run directory (write=False); pass out_dir")
    parents = {Path(d).parent for d in dirs}
    if len(results) > 1 or (Path(dirs[0]).parent / "sweep.json").is_file():
        if len(parents) != 1:
            raise ReportError(
                "write_report: the results are not members of one sweep directory; pass out_dir"
            )
        return results, parents.pop(), True
    return results, Path(dirs[0]), False


# ---- markdown pieces -----------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    if isinstance(x, float | np.floating):
        return f"{x:.4g}" if math.isfinite(x) else str(x)
    return str(x)


def _start_end(v: np.ndarray, w: int = WINDOW) -> tuple[float, float]:
    """Means of the finite values over the first and the last ``w`` iterations (NaN where none is
    finite): the start and the final value."""
    v = np.asarray(v, float)
    return tail_mean(v[:w], w), tail_mean(v, w)


def _its(w: int) -> str:
    return f"{w} iteration{'s' if w != 1 else ''}"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    esc = lambda s: _fmt(s).replace("|", "\\|")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]


def _n_iter(r: RunResult) -> int:
    return max((len(v) for v in r.metrics.values()), default=0)


def _timeline(r: RunResult) -> list[dict[str, Any]]:
    if not _n_iter(r):
        return []
    return timeline(r.metrics, r.config.diag, adaptive=is_adaptive(r.config.ctrl.kind))


def _regime(r: RunResult) -> str:
    return final_regime(r.metrics, r.config.diag) if _n_iter(r) else "-"


def _timeline_table(r: RunResult) -> list[str]:
    events = _timeline(r)
    if not events:
        return ["No metrics logged." if not _n_iter(r) else "No regime change."]
    return _table(
        ["iteration", "event", "regime", "message"],
        [[e["iteration"], e["event"], e.get("regime", ""), e["message"]] for e in events],
    )


def _run_events(d: Path | None) -> list[str]:
    """The run's own events (resume, rollback, ...) from ``events.jsonl``, if any."""
    if d is None or not (Path(d) / "events.jsonl").is_file():
        return []
    rows = read_jsonl(Path(d) / "events.jsonl")
    return _table(
        ["iteration", "event", "message"],
        [[e.get("iteration"), e.get("event"), e.get("message")] for e in rows],
    )


def _config_block(cfg_dict: dict[str, Any], note: str = "") -> list[str]:
    """One line per section: compact, and still valid JSON (``note``: a line after it)."""
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg_dict.items())
    return ["```json", "{\n" + body + "\n}", "```", *([note] if note else [])]


def _applying(cfg: Any) -> tuple[dict[str, Any], str]:
    """The config as the report shows it: on a pretrained ``model.path`` without the built-in GPT's
    fields (:data:`klrl.config.fields.GPT_ONLY`: the model's own config fixes its architecture)."""
    d = cfg.to_dict()
    if not cfg.model.path:
        return d, ""
    d["model"] = {k: v for k, v in d["model"].items() if k not in GPT_ONLY}
    left = ", ".join(f"model.{k}" for k in GPT_ONLY)
    return d, f"Left out: {left} (klrl's built-in GPT; model.path fixes the architecture)."


def _keys(results: list[RunResult]) -> list[str]:
    return [k for k in REPORT_KEYS if any(k in r.metrics for r in results)]


def _varying(results: list[RunResult]) -> list[str]:
    first = results[0].config
    return sorted({f for r in results[1:] for f in config_diff(first, r.config)})


def _get(cfg: Any, dotted: str) -> Any:
    section, field = dotted.split(".", 1)
    return getattr(getattr(cfg, section), field)


def _single(r: RunResult, root: Path, w: int) -> list[str]:
    cfg = r.config
    lines = [
        f"# klrl report: {root.name}",
        "",
        f"{_n_iter(r)} iterations of task `{cfg.task.name}`, {label(r)}, "
        f"controller unit {cfg.ctrl.unit}; final regime: **{_regime(r)}**.",
        "",
        "## Summary",
        "",
    ]
    rows = [[k, unit_of(k), *_start_end(r.metrics[k], w)] for k in _keys([r])]
    lines += _table(["metric", "unit", "start", "final"], rows) if rows else ["No metrics logged."]
    lines += ["", f"Start and final are means over the first and the last {_its(w)} (the window: at most "
              f"{WINDOW}, at most a third of the run); {_SAME}.", ""]  # fmt: skip
    lines += ["## Diagnosis timeline", "", *_timeline_table(r), ""]
    lines += report_lines(r.dir)
    ev = _run_events(r.dir)
    if ev:
        lines += ["## Run events", "", *ev, ""]
    return lines


def _pm(values: list[float]) -> str:
    """``mean ± half`` (95% t-interval over seeds) of the finite values; the mean alone for one."""
    mean, half, n = (float(x[0]) for x in t_interval(np.array(values, float)[:, None]))
    if n == 0:
        return "nan"
    return f"{_fmt(mean)} ± {_fmt(half)}" if n >= 2 else _fmt(mean)


def _settings_table(results: list[RunResult], vary: list[str], keys: list[str], w: int) -> list[str]:
    """One row per setting (configs equal up to ``train.seed``): the final values (means over the
    last ``w`` iterations) as mean ± half-width of the 95% t-interval over its seeds."""
    cols = [v for v in vary if v != "train.seed"]
    rows = []
    for g in seed_groups(results):
        regimes = [_regime(r) for r in g.runs]
        counts = ", ".join(f"{k} x{regimes.count(k)}" if g.n > 1 else k for k in dict.fromkeys(regimes))
        cells = [
            *(_get(g.config, v) for v in cols),
            label(g.config),
            g.n,
            ", ".join(map(str, g.seeds)),
            counts,
        ]
        cells += [
            _pm([tail_mean(r.metrics[k], w) if k in r.metrics else math.nan for r in g.runs]) for k in keys
        ]
        rows.append(cells)
    head = [*cols, "label", "seeds (n)", "train.seed", "final regime", *(f"{k} ({unit_of(k)})" for k in keys)]
    return _table(head, rows)


def _sweep(results: list[RunResult], root: Path, w: int) -> list[str]:
    base = results[0].config
    vary = _varying(results)
    keys = _keys(results)
    n_set = len(seed_groups(results))
    lines = [
        f"# klrl sweep report: {root.name}",
        "",
        f"{len(results)} members, {max(_n_iter(r) for r in results)} iterations of task `{base.task.name}`"
        + (f"; members differ in {', '.join(f'`{v}`' for v in vary)}." if vary else "."),
        "",
        *([f"**{note}**", ""] if (note := cannot_differ_note(results)) else []),
        "## Settings (aggregated over seeds)",
        "",
        *_settings_table(results, vary, keys, w),
        "",
        f"{n_set} settings: members whose configs differ only in `train.seed` (or the run's name). "
        f"Cells are final values (means over the last {_its(w)} of each member: {_SAME}) as the mean over "
        "seeds ± the half-width of its 95% Student-t interval (t with n - 1 degrees of freedom times the "
        "standard deviation over seeds over sqrt(n)); a mean alone where a setting has one seed.",
        "",
        "## Members",
        "",
    ]
    rows = []
    for i, r in enumerate(results):
        cells = [r.dir.name if r.dir is not None else f"{i:02d}", *(_get(r.config, v) for v in vary)]
        cells += [label(r), _regime(r)]
        for k in keys:
            s, e = _start_end(r.metrics[k], w) if k in r.metrics else (math.nan, math.nan)
            cells.append(f"{_fmt(s)} -> {_fmt(e)}")
        rows.append(cells)
    lines += _table(["member", *vary, "label", "final regime", *(f"{k} ({unit_of(k)})" for k in keys)], rows)
    lines += ["", f"Metric cells are start -> final: means over the first and the last {_its(w)} ({_SAME}).",
              "",
              "## Diagnosis timeline", ""]  # fmt: skip
    for i, r in enumerate(results):
        name = r.dir.name if r.dir is not None else f"member {i:02d}"
        lines += [f"### {name}: {label(r)}", "", *_timeline_table(r), ""]
        lines += report_lines(r.dir, "Samples:")
        ev = _run_events(r.dir)
        if ev:
            lines += ["Run events:", "", *ev, ""]
    return lines


# ---- entry points --------------------------------------------------------------------------------
def write_report(
    source: str | Path | RunResult | Sequence[RunResult],
    *,
    out_dir: str | Path | None = None,
    plots: bool = True,
    dpi: int = 90,
    window: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write ``report.md`` (and its PNG plots) for a run or a sweep; return its path.

    ``source`` is a run directory, a sweep directory (``sweep.json``: one report for all
    members), a :class:`RunResult`, or the list of results :func:`klrl.sweep` returned. The report
    goes into that directory (the sweep's root for a list of members) unless ``out_dir`` is given
    (needed for results of ``write=False``). Start and final values are means over the first and
    the last ``window`` iterations (default: :func:`report_window` of the longest run, 10 from 30
    iterations on; the report says which); a sweep's Settings table aggregates them over seeds. Raises
    :class:`ReportError` (a ``ValueError``) naming the path when the source cannot be read.

    A directory's rows are checked first (:func:`check_rows`: a missing or cut ``metrics.jsonl``, or
    fewer rows than its checkpoint counts, raise and leave an existing ``report.md`` untouched);
    ``log`` gets the one line saying what was read. ``report.md`` is replaced atomically.
    """
    results, root, is_sweep = _resolve(source, out_dir)
    if isinstance(source, str | Path):
        try:
            read = check_rows(Path(source), is_sweep)
        except RunDirError as e:
            raise ReportError(str(e)) from e
        if log is not None:
            log(read)
    root.mkdir(parents=True, exist_ok=True)
    if window is None:
        window = report_window(max(_n_iter(r) for r in results))
    lines = _sweep(results, root, window) if is_sweep else _single(results[0], root, window)
    if plots and any(_n_iter(r) for r in results):
        # matplotlib costs about 1 s at import, and ``import klrl`` imports this module
        from klrl.analysis import plots as P

        lines += ["## Plots", ""]
        for name, title in _plots_for(results):
            fig = getattr(P, name)(results, **_window_of(name, window))
            fname = f"report-{name}.png"
            fig.savefig(root / fname, dpi=dpi, bbox_inches="tight")
            lines += [f"### {title}", "", f"![{name}]({fname})", ""]
    first = results[0].dir.name if results[0].dir is not None else "00"
    lines += [
        "## Config" if not is_sweep else f"## Config ({first}; the Members table shows what differs)",
        "",
        *_config_block(*_applying(results[0].config)),
        "",
    ]
    lines += [f"_Written by klrl.analysis.report.write_report on {time.strftime('%Y-%m-%d %H:%M:%S')}._", ""]
    path = root / REPORT_NAME
    replace_file(path, "\n".join(lines).encode())  # (a crash mid-write leaves the old report whole)
    return path


def maybe_write_report(
    source: str | Path | RunResult | Sequence[RunResult], log: Callable[[str], None] | None = None
) -> Path | None:
    """:func:`write_report` for the end of a run: never raises (a failed report must not fail a
    finished run), does nothing for results kept in memory (``write=False``)."""
    items = [source] if isinstance(source, RunResult) else source
    if not isinstance(items, str | Path) and any(r.dir is None for r in items):
        return None
    try:
        return write_report(source)
    except Exception as e:  # noqa: BLE001 - the run is done; its report is a convenience
        if log is not None:
            log(f"report: not written ({type(e).__name__}: {e})")
        return None

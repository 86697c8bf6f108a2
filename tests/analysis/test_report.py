"""klrl.analysis.report on in-memory results (synthetic metrics, nothing compiled): the sweep's Settings table
aggregates members over seeds (mean ± the 95% t-interval computed here from the members' last-window
means), one row per setting, next to the per-member table; final values are trailing-window means.
Reports of a real run and a real sweep directory: tests/e2e/test_api.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_plots import FIGURES, PNG_MAGIC, T975, seeded, study, synthetic

import klrl


def table(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table after ``heading``."""
    lines = text.split(heading, 1)[1].splitlines()
    rows = [ln for ln in lines[: next(i for i, ln in enumerate(lines) if ln.startswith("## ") and i > 0)]
            if ln.startswith("|")]  # fmt: skip
    split = lambda ln: [c.strip() for c in ln.strip("|").split(" | ")]
    return split(rows[0]), [split(r) for r in rows[2:]]


def test_write_report_of_in_memory_results(tmp_path):
    with pytest.raises(ValueError, match="no run directory"):
        klrl.write_report(study())
    path = klrl.write_report(study(), out_dir=tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "## Settings (aggregated over seeds)" in text and "## Members" in text
    assert text.count("| fixed beta=") == 6  # 3 settings of one seed each, 3 members
    for name in FIGURES:  # all five have data here
        assert f"(report-{name}.png)" in text
        assert (tmp_path / f"report-{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_settings_table_is_mean_and_t_interval_over_seeds(tmp_path):
    rs = seeded()  # 2 settings x 3 seeds
    text = klrl.write_report(rs, out_dir=tmp_path, plots=False, window=10).read_text()
    head, rows = table(text, "## Settings (aggregated over seeds)")
    assert len(rows) == 2 and head[:2] == ["ctrl.kind", "kl.beta"]  # train.seed is not a setting column
    assert "reward/gold (a.u.)" in head and "eval/oracle_ppl_floored (exp(nats/token))" in head
    for row, setting in zip(rows, (rs[0::2], rs[1::2]), strict=True):
        cell = dict(zip(head, row, strict=True))
        assert cell["seeds (n)"] == "3" and cell["train.seed"] == "0, 1, 2"
        keys = ("reward/gold", "reward/proxy", "kl/exact_seq_sum", "eval/oracle_ppl_floored", "ctrl/beta")
        for key in keys:
            finals = [sum(r.metrics[key][-10:]) / 10 for r in setting]
            m = sum(finals) / 3
            h = T975[2] * math.sqrt(sum((f - m) ** 2 for f in finals) / 2) / math.sqrt(3)
            mean, half = (
                float(x) for x in cell[f"{key} ({klrl.analysis.aggregate.unit_of(key)})"].split(" ± ")
            )
            assert mean == pytest.approx(m, rel=1e-3, abs=1e-6) and half == pytest.approx(h, rel=1e-3)
    _, members = table(text, "## Members")
    assert len(members) == 6
    # one seed per setting: the mean alone, no interval
    text = klrl.write_report(study(), out_dir=tmp_path, plots=False).read_text()
    _, rows = table(text, "## Settings (aggregated over seeds)")
    assert len(rows) == 4 and not any("±" in c for r in rows for c in r)


def test_single_run_final_is_the_trailing_window_mean(tmp_path):
    r = synthetic(n=40)
    text = klrl.write_report(r, out_dir=tmp_path / "one", plots=False, window=7).read_text()
    head, rows = table(text, "## Summary")
    assert head == ["metric", "unit", "start", "final"]
    by = {row[0]: row for row in rows}
    gold = r.metrics["reward/gold"]
    assert by["reward/gold"][1] == "a.u." and by["kl/exact_seq_sum"][1] == "nats/sequence"
    assert float(by["reward/gold"][2]) == pytest.approx(np.mean(gold[:7]), rel=1e-3)
    assert float(by["reward/gold"][3]) == pytest.approx(np.mean(gold[-7:]), rel=1e-3)


def test_short_run_windows_are_sized_to_the_run(tmp_path):
    """A 3-iteration run's start is iteration 0 and its final iteration 2 (a window of 1, said in the
    report), not the same mean over all three; 40 iterations: 10; a sweep: sized to its members."""
    r = synthetic(n=3)
    gold = r.metrics["reward/gold"]
    assert gold[0] != gold[2]
    text = klrl.write_report(r, out_dir=tmp_path / "short", plots=False).read_text()
    by = {row[0]: row for row in table(text, "## Summary")[1]}
    assert float(by["reward/gold"][2]) == pytest.approx(gold[0], rel=1e-3)
    assert float(by["reward/gold"][3]) == pytest.approx(gold[2], rel=1e-3)
    assert "the first and the last 1 iteration (the window" in text
    assert [klrl.analysis.report.report_window(n) for n in (1, 3, 6, 29, 30, 500)] == [1, 1, 2, 9, 10, 10]
    text = klrl.write_report(synthetic(n=40), out_dir=tmp_path / "long", plots=False).read_text()
    assert "the first and the last 10 iterations" in text
    sweep = [synthetic(b, seed=i, n=6) for i, b in enumerate((0.01, 0.1))]
    text = klrl.write_report(sweep, out_dir=tmp_path / "sw", plots=False).read_text()
    assert "the last 2 iterations of each member" in text and "the first and the last 2 iterations (" in text


def test_config_block_leaves_out_the_gpt_fields_on_a_pretrained_model(tmp_path):
    """report.md's config of a model.path run has no n_layers or d_model (the model's own config fixes
    them) and says so; a testbed run keeps them."""
    import dataclasses

    r = synthetic(n=6)
    text = klrl.write_report(r, out_dir=tmp_path / "gpt", plots=False).read_text()
    assert '"n_layers": 2' in text and "Left out" not in text
    cfg = r.config.replace(model={"path": "/m/SmolLM2.gguf"}, task={"name": "text"})
    r = dataclasses.replace(r, config=cfg)
    text = klrl.write_report(r, out_dir=tmp_path / "hf", plots=False).read_text()
    config = text.split("## Config", 1)[1]
    assert '"path": "/m/SmolLM2.gguf"' in config
    assert '"n_layers"' not in config and '"d_model"' not in config and "Left out: model.n_layers" in config


def test_plots_end_on_the_tables_final_values(tmp_path, monkeypatch):
    """The report draws its curves with its own window (issue 48: the beta-KL plot ended at the trailing
    10-iteration mean, 0.055, where the table said 0.1096, the last value): the last point of each KL
    and beta curve, and the frontier's large point, are the table's final values, and both say so."""
    from klrl.analysis import plots as P

    rs = [synthetic(b, kind, seed=i, n=8) for i, (b, kind) in enumerate(((0.01, "fixed"), (0.05, "pi")))]
    figs = {}
    for name in ("beta_kl", "frontier"):
        real = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _f=real, _n=name, **k: figs.setdefault(_n, _f(*a, **k)))
    text = klrl.write_report(rs, out_dir=tmp_path).read_text()
    w = klrl.analysis.report.report_window(8)
    assert w == 2 and "the last point of each curve in the plots" in text
    _, members = table(text, "## Members")
    head = table(text, "## Members")[0]
    ax_b, ax_k = figs["beta_kl"].axes[:2]
    front = figs["frontier"].axes[0]
    for j, (row, r) in enumerate(zip(members, rs, strict=True)):
        cell = dict(zip(head, row, strict=True))
        final = lambda key: float(cell[f"{key} ({klrl.analysis.aggregate.unit_of(key)})"].split(" -> ")[1])
        kl = r.metrics["kl/exact_seq_sum"]
        assert final("kl/exact_seq_sum") == pytest.approx(np.mean(kl[-w:]), rel=1e-3)
        assert ax_k.lines[j].get_ydata()[-1] == pytest.approx(final("kl/exact_seq_sum"), rel=1e-3)
        assert ax_b.lines[j].get_ydata()[-1] == pytest.approx(final("ctrl/beta"), rel=1e-3)
        large = [ln for ln in front.lines if ln.get_markersize() == 8][j]  # the last window's point
        assert large.get_xdata()[0] == pytest.approx(final("kl/exact_seq_sum"), rel=1e-3)
        assert large.get_ydata()[0] == pytest.approx(final("reward/proxy"), rel=1e-3)
    titles = [leg.get_title().get_text() for leg in figs["beta_kl"].legends + ax_b.get_children()
              if hasattr(leg, "get_title") and hasattr(leg, "get_texts")]  # fmt: skip
    assert any(f"trailing {w}-iteration means" in t and f"mean of the last {w}" in t for t in titles), titles


def test_a_sweep_whose_kl_never_moved_says_its_members_cannot_differ(tmp_path):
    """Members differing only in beta while the KL stays ~0 (a 2-iteration sweep): one line says why
    they are the same run so far; members with a KL that moved, or differing in a seed, get none."""
    from klrl.analysis.results import RunResult
    from klrl.analysis.summary import KL_AT_ZERO, cannot_differ_note, summary_table

    def member(beta, kl, **cfg):
        m = {"kl/exact_seq_sum": np.asarray(kl, float), "ctrl/beta": np.full(len(kl), beta),
             "reward/task": np.zeros(len(kl))}  # fmt: skip
        return RunResult(klrl.RunConfig().replace(kl={"beta": beta}, **cfg), None, m)

    still = [member(b, [-3.5e-7, 4e-4]) for b in (0.01, 0.1, 1.0)]
    note = cannot_differ_note(still)
    assert note is not None and note.startswith("Members cannot differ yet: they differ only in kl.beta")
    assert "largest |kl/exact_seq_sum| 0.0004" in note and f"below {KL_AT_ZERO:g} nats/sequence" in note
    assert note in klrl.write_report(still, out_dir=tmp_path, plots=False).read_text()
    assert summary_table(still, ["kl.beta"]).endswith(note)
    assert cannot_differ_note([member(b, [0.0, 0.5]) for b in (0.01, 0.1)]) is None  # the KL moved
    seeds = [member(0.1, [0.0, 1e-4], train={"seed": s}) for s in (0, 1)]
    assert cannot_differ_note(seeds) is None  # seeds differ whatever the KL

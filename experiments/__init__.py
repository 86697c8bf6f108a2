"""klrl's experiments: the studies behind FINDINGS.md, their shared pieces and their reports.

A package, so that its modules import each other as ``experiments.NAME`` (no ``sys.path`` edits when
imported, no import cycles). Each study runs by path, as its docstring says (``python
experiments/NAME.py ...``: a script run so puts the repo root on ``sys.path`` first, in one guarded
block, for ``experiments.*`` and an uninstalled klrl), or as ``python -m experiments.NAME ...``.

Shared: :mod:`experiments.study` (the testbed studies' sweep, tables and plots), :mod:`experiments.llm_beta`
(padding, the default GGUF), :mod:`experiments.llm_overopt` (gzip'd results, proxy pairs),
:mod:`experiments.llm_overopt_gold` (that study's gold, which its report recomputes).
"""

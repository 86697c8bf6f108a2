"""The statistics of a reward over-optimisation study (Gao, Schulman, Hilton 2023), as small pure functions.

* :func:`kl_bon`: the KL of best-of-n sampling from the reference, ``log n - (n - 1) / n`` nats
  (Stiennon et al. 2020, appendix; Gao et al. 2023, section 2).
* :func:`bon_expectation`: the unbiased estimate of ``E[gold(argmax_proxy of n draws)]`` from ``K >= n``
  draws per prompt (Nakano et al. 2021, WebGPT appendix; Gao et al. 2023 use it for their best-of-n curves).
* :func:`fit_bon` and :func:`klrl.analysis.aggregate.fit_gao`: the two functional forms of Gao et al.
  (``d = sqrt(KL)``): best-of-n ``R(d) = d (alpha - b d)``, RL ``R(d) = d (alpha - b log d)``;
  :func:`turn` is where each peaks.
* :func:`tost`: the two one-sided t-tests of equivalence (Schuirmann 1987) over seeds: "flat" means the
  mean change lies inside ``(-margin, margin)``, not that an interval contains 0.
* :func:`wilson`: the Wilson score interval of an accuracy (Wilson 1927).
* :func:`prompt_bootstrap`: the percentile interval of a statistic over prompts resampled with replacement
  (a cluster bootstrap, Davison & Hinkley 1997, section 3.8: the prompt is the unit that varies; responses
  to one prompt, and pairs that share responses, are not independent draws).
* :func:`pair_accuracy`: a proxy's accuracy against the gold on every within-prompt pair of responses, with
  its prompt-bootstrap interval; :func:`accuracy_difference`: two proxies on the same pairs, paired by prompt.
"""

from __future__ import annotations

from math import comb
from typing import Any

import numpy as np
from scipy.stats import norm, t

LEVEL = 0.95


def kl_bon(n: Any) -> np.ndarray:
    """``KL(best-of-n || reference) = log n - (n - 1) / n`` nats per sequence (exact for a continuous
    selection score; an upper bound with ties), ``n >= 1``."""
    n = np.asarray(n, float)
    if np.any(n < 1):
        raise ValueError(f"kl_bon: n must be >= 1, got {n.min():g}")
    return np.log(n) - (n - 1.0) / n


def bon_weights(k: int, n: int) -> np.ndarray:
    """``w[i]`` = the probability that, among ``n`` of ``k`` draws chosen uniformly without replacement,
    the one with the ``i``-th smallest selection score (0-based) is the largest: ``C(i, n-1) / C(k, n)``."""
    if not 1 <= n <= k:
        raise ValueError(f"bon_weights: need 1 <= n <= k, got n={n}, k={k}")
    return np.array([comb(i, n - 1) for i in range(k)], float) / comb(k, n)


def bon_expectation(select: Any, value: Any, n: int) -> np.ndarray:
    """Per prompt, the unbiased estimate of ``E[value of the draw the selector ranks highest among n]``
    from ``K >= n`` draws (``select``, ``value``: ``[prompts, K]``): ``sum_i w_i value_(i)``, the draws
    sorted by ``select`` (ties broken by position, a stable sort) and ``w`` :func:`bon_weights`."""
    s, v = np.asarray(select, float), np.asarray(value, float)
    if s.shape != v.shape or s.ndim != 2:
        raise ValueError(f"bon_expectation: select and value must be [prompts, K], got {s.shape}, {v.shape}")
    order = np.argsort(s, axis=1, kind="stable")
    return np.take_along_axis(v, order, axis=1) @ bon_weights(s.shape[1], n)


def fit_bon(d: Any, r: Any) -> tuple[float, float]:
    """Least-squares ``(alpha, b)`` of the best-of-n form ``R(d) = d (alpha - b d) = alpha d - b d^2``
    (Gao et al. 2023, eq. 1), ``d = sqrt(KL)``, ``R`` the gold gain over the reference; non-finite pairs
    dropped; fewer than two points with ``d > 0`` raise :class:`ValueError`."""
    d, r = np.asarray(d, float).ravel(), np.asarray(r, float).ravel()
    ok = np.isfinite(d) & np.isfinite(r) & (d >= 0)
    d, r = d[ok], r[ok]
    if np.count_nonzero(d) < 2:
        raise ValueError(f"fit_bon: needs at least two points with d > 0 (got {np.count_nonzero(d)})")
    (alpha, b), *_ = np.linalg.lstsq(np.stack([d, -(d**2)], axis=1), r, rcond=None)
    return float(alpha), float(b)


def bon_curve(d: Any, alpha: float, b: float) -> np.ndarray:
    """``R(d) = d (alpha - b d)``."""
    d = np.asarray(d, float)
    return d * (alpha - b * d)


def turn(alpha: float, b: float, form: str) -> float:
    """The ``d = sqrt(KL)`` at which the fitted gold peaks: best-of-n (``form='bon'``) ``alpha / (2 b)``,
    RL (``'rl'``, ``dR/dd = alpha - b log d - b = 0``) ``exp(alpha / b - 1)``; ``inf`` where the fit has no
    interior maximum (``b <= 0``: the gold still rises at every d)."""
    if form not in ("bon", "rl"):
        raise ValueError(f"turn: form must be 'bon' or 'rl', got {form!r}")
    if not b > 0:
        return float("inf")
    return float(alpha / (2 * b)) if form == "bon" else float(np.exp(alpha / b - 1.0))


def tost(x: Any, margin: float, level: float = LEVEL) -> dict[str, float]:
    """Two one-sided t-tests that the mean of ``x`` (one value per seed) lies in ``(-margin, margin)``.

    ``p = max(P[T >= (m + margin) / se], P[T <= (m - margin) / se])``, ``T ~ t_{n-1}``, ``se = s / sqrt(n)``;
    equivalence is shown at ``level`` when ``p < 1 - level``, i.e. when the ``1 - 2 (1 - level)``
    (90% for 95%) t-interval lies inside the margin. Returns ``{mean, lo90, hi90, p, equivalent, n}``."""
    x = np.asarray(x, float).ravel()
    x = x[np.isfinite(x)]
    if margin <= 0:
        raise ValueError(f"tost: margin must be > 0, got {margin}")
    n = len(x)
    if n < 2:
        return {"mean": float(x.mean()) if n else float("nan"), "lo90": float("nan"), "hi90": float("nan"),
                "p": float("nan"), "equivalent": False, "n": n}  # fmt: skip
    m, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(n))
    se = max(se, 1e-300)
    p = max(t.sf((m + margin) / se, n - 1), t.cdf((m - margin) / se, n - 1))
    half = t.ppf(level, n - 1) * se
    return {"mean": m, "lo90": m - half, "hi90": m + half, "p": float(p), "equivalent": bool(p < 1 - level),
            "n": n}  # fmt: skip


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k / n``:
    ``(p + z^2/2n -+ z sqrt(p (1-p) / n + z^2 / 4n^2)) / (1 + z^2 / n)``, ``z`` the normal quantile."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    z = norm.ppf((1 + level) / 2)
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(c - h), float(c + h)


def prompt_bootstrap(
    groups: list[Any], stat: Any, n_boot: int = 2000, seed: int = 0, level: float = LEVEL
) -> dict[str, float]:
    """``{"value", "lo", "hi", "n_prompts", "n_boot"}``: ``stat(groups)`` and the percentile interval of
    ``stat`` over ``n_boot`` resamples of the groups (one group per prompt, whatever each holds), drawn with
    replacement with ``numpy.random.default_rng(seed)``."""
    if not groups:
        raise ValueError("prompt_bootstrap: no prompts")
    rng = np.random.default_rng(seed)
    value = float(stat(groups))
    draws = np.array(
        [stat([groups[i] for i in rng.integers(0, len(groups), len(groups))]) for _ in range(n_boot)]
    )
    ok = draws[~np.isnan(draws)]  # a resample whose statistic is undefined is left out; inf (no turn) is kept
    q = [(1 - level) / 2, (1 + level) / 2]  # the percentiles of the draws themselves (no interpolation)
    lo, hi = np.quantile(ok, q, method="inverted_cdf") if ok.size else (np.nan, np.nan)
    return {"value": value, "lo": float(lo), "hi": float(hi), "n_prompts": len(groups), "n_boot": n_boot}


def _pair_counts(score: np.ndarray, gold: np.ndarray) -> tuple[int, int]:
    """``(agreements, pairs)`` over the pairs ``i < j`` of one prompt's responses with different gold:
    the proxy orders the pair as the gold does (a proxy tie counts one half)."""
    ds = score[:, None] - score[None, :]
    dg = gold[:, None] - gold[None, :]
    upper = np.triu(np.ones_like(dg, bool), 1) & (dg != 0)
    agree = np.where(ds == 0, 0.5, (np.sign(ds) == np.sign(dg)).astype(float))
    return float(agree[upper].sum()), int(upper.sum())


def _accuracy(groups: list[tuple[float, int]]) -> float:
    k = sum(g[0] for g in groups)
    n = sum(g[1] for g in groups)
    return k / n if n else float("nan")


def pair_accuracy(
    score: Any, gold: Any, prompt: Any, n_boot: int = 2000, seed: int = 0, level: float = LEVEL
) -> dict[str, float]:
    """A proxy's pairwise accuracy against the gold over every within-prompt pair of responses whose gold
    differs (pooled: agreements / pairs), with the prompt-bootstrap interval (:func:`prompt_bootstrap`);
    ``score``, ``gold``, ``prompt`` are ``[M]`` per response. Adds ``pairs``."""
    score, gold, prompt = (np.asarray(x) for x in (score, gold, prompt))
    groups = [_pair_counts(score[prompt == q], gold[prompt == q]) for q in np.unique(prompt)]
    groups = [g for g in groups if g[1]]
    out = prompt_bootstrap(groups, _accuracy, n_boot, seed, level)
    return {**out, "pairs": int(sum(g[1] for g in groups))}


def accuracy_difference(
    a: Any, b: Any, gold: Any, prompt: Any, n_boot: int = 2000, seed: int = 0, level: float = LEVEL
) -> dict[str, float]:
    """``accuracy(a) - accuracy(b)`` on the same within-prompt pairs (:func:`pair_accuracy`), with the
    interval of a prompt bootstrap that resamples both together (paired): the two proxies are separated
    at ``level`` when the interval excludes 0."""
    a, b, gold, prompt = (np.asarray(x) for x in (a, b, gold, prompt))
    groups = []
    for q in np.unique(prompt):
        m = prompt == q
        ka, n = _pair_counts(a[m], gold[m])
        kb, _ = _pair_counts(b[m], gold[m])
        if n:
            groups.append((ka, kb, n))
    diff = lambda gs: (sum(g[0] for g in gs) - sum(g[1] for g in gs)) / max(sum(g[2] for g in gs), 1)
    out = prompt_bootstrap(groups, diff, n_boot, seed, level)
    return {**out, "pairs": int(sum(g[2] for g in groups)), "separated": bool(out["lo"] > 0 or out["hi"] < 0)}

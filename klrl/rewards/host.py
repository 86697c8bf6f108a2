"""Host-side text rewards behind one callback, usable inside ``jit``, ``vmap`` and ``shard_map``.

Reward functions have TRL's ``reward_funcs`` signature,
``fn(prompts=list, completions=list[str], completion_ids=list[list[int]], **columns) -> list``:
``prompts`` are the pool's prompt values (strings or message lists, as read), ``completions`` the
decoded responses, ``columns`` the prompt data's other columns for these rows. A function gets
only the keywords it names unless it takes ``**kwargs``. Several functions are combined as TRL
does: ``score = nansum_j(w_j * r_j)`` with ``None`` read as NaN, i.e. a function returning
``None`` for a completion has no say in its score (a completion where every function says
``None`` scores 0.0, as ``torch.nansum`` gives, and is counted in ``HostReward.n_all_none``).
Unlike TRL, a *returned* NaN or inf is an error, not a skip: it ends the run.

The callback: ``jax.pure_callback`` with ``vmap_method="expand_dims"``. Scoring text is a pure
function of (prompt, completion, columns), so the purity contract holds; it batches under
``vmap`` (a sweep axis) into ONE host call that gets the stacked ``[S, B, R]`` batch, where
``io_callback`` would loop over the members one call at a time; and it composes with
``shard_map`` (one call per device shard, on the host owning the device) and ``jit``.
``io_callback``'s guarantees (ordering, never duplicated nor dropped) are not needed: the scores
are consumed (so the call is not dropped), a duplicated call recomputes the same scores, and
errors travel as values (the error code), not as host-side ordering.

Errors cannot be raised through XLA, so the callback records them: a function that raises,
returns a non-finite value, the wrong number of values or a non-number sets a nonzero code on the
affected rows (``RAISED``, ``NOT_FINITE``, ``WRONG_COUNT``, ``WRONG_TYPE``; the score there is
0.0) and its message goes to the reward's host-side registry. In a training run
(``stop_after_error=True``, the text task) a failure makes every row of that call and of every
later call an error (``ABORTED``), so the text task's reward is NaN there and the step's guard rejects
the iteration and every later one; the loop, seeing a rejected iteration, calls ``reward.check()``:
it raises :class:`RewardFunctionError` with one line, e.g. ``reward function mod:fn: returned 7
values for 8 completions``, and the loop saves the last good state and ends the run. Under several processes
each process records the errors of its own devices; ``check(error)`` with the gathered codes
raises everywhere (with the message where it is known, the code's meaning elsewhere).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.data.prompts import one_line
from klrl.data.tokenizer import Tokenizer
from klrl.rewards import text

MAX_MESSAGES = 32
OK, RAISED, NOT_FINITE, WRONG_COUNT, WRONG_TYPE, ABORTED = 0, 1, 2, 3, 4, 5
MEANING = {
    RAISED: "raised",
    NOT_FINITE: "returned a non-finite value",
    WRONG_COUNT: "returned the wrong number of values",
    WRONG_TYPE: "returned a value that is not a number",
    ABORTED: "failed earlier (no later call is scored)",
}


class RewardLoadError(ValueError):
    """A reward function cannot be loaded. The message names the spec and the problem."""


class RewardFunctionError(RuntimeError):
    """A reward function failed during the run. The message names the function and the problem."""


def load_reward_fn(spec: str) -> Callable:
    """A reward function from ``name`` (built-in, see :mod:`klrl.rewards.text`), ``module:function``
    or ``path/to/file.py:function``."""
    if ":" not in spec:
        try:
            return text.get(spec)
        except KeyError as e:
            raise RewardLoadError(
                f"reward {spec!r}: {e.args[0]}; or use module:function or file.py:function"
            ) from None
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RewardLoadError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise RewardLoadError(f"reward {spec!r}: file {path} not found")
        try:
            name = f"klrl_reward_{path.stem}_{abs(hash(str(path.resolve())))}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module  # as `import` does: dataclasses and pickle look the module up
            mod_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise RewardLoadError(f"reward {spec!r}: {path} does not import ({one_line(e)})") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise RewardLoadError(
                f"reward {spec!r}: module {where} does not import ({one_line(e)})"
            ) from None
    if not hasattr(module, attr):
        raise RewardLoadError(f"reward {spec!r}: {where} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardLoadError(f"reward {spec!r}: {attr} is a {type(fn).__name__}, not callable")
    return fn


def parse_specs(specs: str, weights: str = "") -> tuple[list[str], list[float] | None]:
    """``"positivity,my.py:fn"`` and ``"1,0.5"`` (config strings) -> specs and weights (None: all 1)."""
    names = [s.strip() for s in specs.split(",") if s.strip()]
    if not names:
        raise RewardLoadError("reward: no reward function given")
    if not weights.strip():
        return names, None
    try:
        ws = [float(w) for w in weights.split(",")]
    except ValueError:
        raise RewardLoadError(f"reward weights {weights!r}: expected comma-separated numbers") from None
    return names, ws


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _accepted(fn: Callable) -> set[str] | None:
    """The keyword names ``fn`` accepts; None if it takes ``**kwargs`` (or cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


class HostReward:
    """Scores ``(prompt_idx [B], response [B, R], mask [B, R])`` with host-side text reward functions.

    ``reward(prompt_idx, response, mask) -> (scores [B] float32, error [B] int32)`` inside or
    outside ``jit``; ``components`` also returns each function's raw values ``[B, F]`` (NaN where
    ``None`` or failed); ``score_numpy`` is the host function itself. Leading batch axes (vmap's)
    pass through. Response tokens count where ``mask > 0``; a final stop id is dropped before
    decoding.
    """

    def __init__(
        self,
        fns: Sequence[Callable | str],
        weights: Sequence[float] | None,
        tokenizer: Tokenizer,
        prompts: Sequence[Any],
        columns: dict[str, Sequence[Any]] | None = None,
        *,
        stop_after_error: bool = False,
    ):
        if not fns:
            raise RewardLoadError("reward: no reward function given")
        self.names = tuple(f if isinstance(f, str) else _name(f) for f in fns)
        self.fns = tuple(load_reward_fn(f) if isinstance(f, str) else f for f in fns)
        for n, f in zip(self.names, self.fns, strict=True):
            if not callable(f):
                raise RewardLoadError(f"reward {n}: a {type(f).__name__}, not callable")
        w = [1.0] * len(self.fns) if weights is None else [float(x) for x in weights]
        if len(w) != len(self.fns):
            raise RewardLoadError(f"reward weights: {len(w)} weights for {len(self.fns)} reward functions")
        if not all(math.isfinite(x) for x in w):
            raise RewardLoadError(f"reward weights: must be finite (got {w})")
        self.weights = np.asarray(w, dtype=np.float64)
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.columns = {k: list(v) for k, v in (columns or {}).items()}
        for k, v in self.columns.items():
            if len(v) != len(self.prompts):
                raise RewardLoadError(f"reward column {k!r}: {len(v)} values for {len(self.prompts)} prompts")
        self._accepts = tuple(_accepted(f) for f in self.fns)
        self._stops = frozenset(int(s) for s in tokenizer.stop_ids)
        # a training run's mode: once a function failed, every row of that call and of every later call
        # is an error (ABORTED where nothing else went wrong), so no later iteration is accepted
        self.stop_after_error = stop_after_error
        self._lock = threading.RLock()  # device shards call back from several threads: one at a time
        self.errors: list[str] = []  # the first MAX_MESSAGES problems, in the order they happened
        self.n_errors = 0
        self.n_all_none = 0
        self.n_calls = 0

    # ---- host side ---------------------------------------------------------------------------

    def decode(self, ids: np.ndarray, mask: np.ndarray) -> tuple[str, list[int]]:
        kept = [int(t) for t, m in zip(ids, mask, strict=True) if m > 0]
        if kept and kept[-1] in self._stops:
            kept = kept[:-1]
        return self.tokenizer.decode(kept, skip_special_tokens=True), kept

    def _record(self, j: int | None, problem: str) -> None:
        with self._lock:
            self.n_errors += 1
            if len(self.errors) < MAX_MESSAGES:  # a batch of NaNs must not grow the registry without end
                self.errors.append(
                    f"reward function {self.names[j]}: {problem}" if j is not None else problem
                )

    def score_numpy(self, prompt_idx, response, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(scores, per_function [..., F], error)`` for NumPy inputs with any leading batch axes.

        Calls are serialised (the reward functions and the tokenizer need not be thread-safe)."""
        with self._lock:
            return self._score(prompt_idx, response, mask)

    def _score(self, prompt_idx, response, mask):
        prompt_idx, response, mask = np.asarray(prompt_idx), np.asarray(response), np.asarray(mask)
        lead = np.broadcast_shapes(prompt_idx.shape, response.shape[:-1], mask.shape[:-1])
        r = response.shape[-1]
        idx = np.broadcast_to(prompt_idx, lead).reshape(-1)
        resp = np.broadcast_to(response, (*lead, r)).reshape(-1, r)
        msk = np.broadcast_to(mask, (*lead, r)).reshape(-1, r)
        m, f = idx.shape[0], len(self.fns)
        if self.stop_after_error and self.n_errors:
            return (
                np.zeros(lead, np.float32),
                np.full((*lead, f), np.nan, np.float32),
                np.full(lead, ABORTED, np.int32),
            )
        try:  # never raise through XLA: a bad prompt index or an undecodable id is recorded too
            bad = idx[(idx < 0) | (idx >= len(self.prompts))]
            if bad.size:
                raise IndexError(
                    f"prompt index {int(bad[0])} outside the pool of {len(self.prompts)} prompts"
                )
            decoded = [self.decode(resp[i], msk[i]) for i in range(m)]
        except Exception as e:
            self._record(None, f"reward callback: cannot decode the completions ({one_line(e)})")
            return (
                np.zeros(lead, np.float32),
                np.full((*lead, f), np.nan, np.float32),
                np.full(lead, RAISED, np.int32),
            )
        kwargs: dict[str, Any] = {
            "prompts": [self.prompts[i] for i in idx],
            "completions": [d[0] for d in decoded],
            "completion_ids": [d[1] for d in decoded],
            **{k: [v[i] for i in idx] for k, v in self.columns.items()},
        }
        at = lambda i: i if len(lead) == 1 else tuple(int(x) for x in np.unravel_index(i, lead))
        values = np.full((m, f), np.nan)
        error = np.zeros(m, dtype=np.int32)
        for j, fn in enumerate(self.fns):
            acc = self._accepts[j]
            kw = kwargs if acc is None else {k: v for k, v in kwargs.items() if k in acc}
            try:
                out = fn(**kw)
            except Exception as e:
                self._record(j, f"raised {one_line(e)}")
                error[:] = np.where(error == OK, RAISED, error)
                continue
            if not isinstance(out, Sequence | np.ndarray) or isinstance(out, str | bytes):
                self._record(j, f"returned a {type(out).__name__}, not a list of {m} values")
                error[:] = np.where(error == OK, WRONG_TYPE, error)
                continue
            if len(out) != m:
                self._record(j, f"returned {len(out)} values for {m} completions")
                error[:] = np.where(error == OK, WRONG_COUNT, error)
                continue
            for i, v in enumerate(out):
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                    self._record(j, f"returned a {type(v).__name__} for completion {at(i)}, not a number")
                    error[i] = error[i] or WRONG_TYPE
                elif not math.isfinite(float(v)):
                    self._record(j, f"returned {float(v)} for completion {at(i)} (prompt row {int(idx[i])})")
                    error[i] = error[i] or NOT_FINITE
                else:
                    values[i, j] = float(v)
        if self.stop_after_error and (error != OK).any():
            error[:] = np.where(error == OK, ABORTED, error)
        none = np.isnan(values).all(axis=1) & (error == OK)
        scores = np.where(error == OK, np.nansum(values * self.weights, axis=1), 0.0)
        self.n_calls += 1
        self.n_all_none += int(none.sum())
        return (
            scores.astype(np.float32).reshape(lead),
            values.astype(np.float32).reshape(*lead, f),
            error.reshape(lead),
        )

    # ---- device side -------------------------------------------------------------------------

    def components(self, prompt_idx: jax.Array, response: jax.Array, mask: jax.Array):
        """``(scores [B], per_function [B, F], error [B] int32)`` via ``jax.pure_callback``."""
        lead = jnp.broadcast_shapes(prompt_idx.shape, response.shape[:-1], mask.shape[:-1])
        out = (
            jax.ShapeDtypeStruct(lead, jnp.float32),
            jax.ShapeDtypeStruct((*lead, len(self.fns)), jnp.float32),
            jax.ShapeDtypeStruct(lead, jnp.int32),
        )
        args = (jnp.asarray(prompt_idx, jnp.int32), jnp.asarray(response, jnp.int32), jnp.asarray(mask))
        return jax.pure_callback(self.score_numpy, out, *args, vmap_method="expand_dims")

    def __call__(self, prompt_idx: jax.Array, response: jax.Array, mask: jax.Array):
        scores, _, error = self.components(prompt_idx, response, mask)
        return scores, error

    # ---- the loop's side ---------------------------------------------------------------------

    def check(self, error: Any = None) -> None:
        """Raise :class:`RewardFunctionError` (one line) if a reward function failed.

        ``error`` (the step's error codes; fetching it waits for the step) is optional where the
        step has already been waited for; without it only this process's registry is read.
        """
        codes = None if error is None else np.asarray(error)
        with self._lock:
            first, more = (self.errors[0], self.n_errors - 1) if self.errors else (None, 0)
        if first is not None:
            raise RewardFunctionError(first + (f" (and {more} more problems)" if more else ""))
        if codes is not None and np.any(codes != OK):
            code = int(codes[codes != OK].flat[0])
            raise RewardFunctionError(
                f"reward function {MEANING.get(code, f'failed (code {code})')} on another process"
            )

    def reset(self) -> None:
        """Forget recorded errors (e.g. after a rollback the loop chose to retry)."""
        with self._lock:
            self.errors.clear()
            self.n_errors = 0


def make_host_reward(
    fns: Sequence[Callable | str],
    weights: Sequence[float] | None,
    tokenizer: Tokenizer,
    prompts: Sequence[Any],
    columns: dict[str, Sequence[Any]] | None = None,
    *,
    stop_after_error: bool = False,
) -> HostReward:
    """A :class:`HostReward` over the pool ``prompts`` (index ``prompt_idx`` into it) and ``columns``."""
    return HostReward(fns, weights, tokenizer, prompts, columns, stop_after_error=stop_after_error)

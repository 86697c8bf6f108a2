"""Host-side text rewards behind one callback, usable inside ``jit``, ``vmap`` and ``shard_map``.

Reward functions have TRL's ``reward_funcs`` signature,
``fn(prompts=list, completions=list[str], completion_ids=list[list[int]], **columns) -> list``:
``prompts`` are the pool's prompt values (strings or message lists, as read), ``completions`` the
decoded responses, ``columns`` the prompt data's other columns for these rows. A function gets
only the keywords it names unless it takes ``**kwargs``. Several functions are combined as TRL
does: ``score = nansum_j(w_j * r_j)`` with ``None`` read as NaN, i.e. a function returning
``None`` for a completion has no say in its score (a completion where every function says
``None`` scores 0.0, as ``torch.nansum`` gives, and is counted in ``HostReward.n_all_none``; the train step
logs the fraction of such completions per iteration as ``reward/all_none_frac``).
**No score at all**: when every function returns ``None`` for every completion of
:data:`ALL_NONE_LIMIT` consecutive training calls (a call is one iteration's batch, or one device's
share of it; a sweep's members are one call), the functions give the policy nothing to learn from (its
task reward is 0 throughout), so it is a failure like a raised exception: that call's rows are errors
(``NO_SCORE``), the iteration is rejected, and the run ends in one line naming the functions with the
last good state saved (docs/reliability.md). A single all-``None`` batch is allowed (a verifier that
applies to few prompts may score none of a small batch).
Unlike TRL, a *returned* NaN or inf is an error, not a skip: it ends the run. Values are checked
as the step sees them, in float32: ``1e39`` (finite in Python, inf in float32) is not finite, and
so is a weighted sum that overflows float32.

**Conversational completions** (TRL's rule, ``completions="auto"``, ``reward.completions``): where
the row's prompt is a conversation (a list of ``{"role", "content"}`` messages), its completion is
TRL's message list ``[{"role": "assistant", "content": text}]``; where it is a string, the completion
is the text (``GRPOTrainer`` decides by ``is_conversational`` of the prompt in the same way).
``completions="text"`` always passes the text, ``"messages"`` always the message list. A function
that reads ``c[0]["content"]`` from a string, or calls a string method on a message list, fails on
its first call with the rule and the setting that changes it in the message (:func:`describe`).

Before anything compiles, :func:`klrl.checks.check_reward` checks each function's signature
(:func:`check_signature`: it takes ``completions`` by name, or ``**kwargs``, and every other
argument it requires is one klrl passes) and calls it once (:meth:`HostReward.probe`) on the first
prompts, their own decoded text standing in for the completions: a wrong signature or a function
that fails on any input is one line in seconds, not after the compile.

What the function does is its failure, whatever it raises: an exception, ``sys.exit()``
(``SystemExit``) or ``KeyboardInterrupt`` end the run as one line naming the function and what it
did. A real Ctrl-C never reaches a reward function as ``KeyboardInterrupt``: during a run
:class:`klrl.loop.reliability.StopSignals` handles SIGINT (it stops after the iteration with a
checkpoint), and the training-time calls run on XLA's callback threads, which Python signals never
interrupt. Only where no such handler is installed and a SIGINT did arrive while the function ran
on the main thread (e.g. the check called by hand) is ``KeyboardInterrupt`` passed on as the user's.

A call that has not returned after ``timeout`` seconds (``reward.timeout``, 600 by default in a run) is
the function's failure too (``TIMED_OUT``): the function runs on a daemon thread that the caller waits
for that long; Python cannot stop a thread, so the hung call is left running, no later call is made
(``stop_after_error``) and the process exits through the failure path all the same.

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

import contextlib
import importlib
import importlib.util
import inspect
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.data.prompts import one_line
from klrl.data.tokenizer import Tokenizer
from klrl.rewards import text

MAX_MESSAGES = 32
F32_MAX = float(np.finfo(np.float32).max)
# keywords every call passes (besides the prompt data's columns)
PASSED = ("prompts", "completions", "completion_ids")
STRINGS_HINT = (
    "completions are plain strings (the decoded text), not TRL conversational message lists (those come "
    "for conversation prompts, or with reward.completions=messages): use c, not c[0]['content']"
)
MESSAGES_HINT = (
    "completions are TRL conversational message lists [{'role': 'assistant', 'content': text}] as the "
    "prompts are conversations: use c[0]['content'], or set reward.completions=text for plain strings"
)
COMPLETION_FORMS = ("auto", "text", "messages")
OK, RAISED, NOT_FINITE, WRONG_COUNT, WRONG_TYPE, ABORTED, NO_SCORE = 0, 1, 2, 3, 4, 5, 6
TIMED_OUT = 7  # a call that had not returned after ``timeout`` seconds (reward.timeout)
ALL_NONE_LIMIT = 3  # consecutive training calls scoring no completion at all end the run (NO_SCORE)
MEANING = {
    NO_SCORE: f"returned None for every completion of {ALL_NONE_LIMIT} consecutive batches",
    RAISED: "raised",
    NOT_FINITE: "returned a non-finite value",
    WRONG_COUNT: "returned the wrong number of values",
    WRONG_TYPE: "returned a value that is not a number",
    ABORTED: "failed earlier (no later call is scored)",
    TIMED_OUT: "did not return in time (reward.timeout)",
}


class RewardLoadError(ValueError):
    """A reward function cannot be loaded. The message names the spec and the problem."""


class RewardFunctionError(RuntimeError):
    """A reward function failed during the run. The message names the function and the problem."""


class _TimedOut(Exception):
    """A reward function's call that had not returned in time (:meth:`HostReward._invoke`)."""


def describe(e: BaseException) -> str:
    """What user code did, on one line: ``called sys.exit(5)``, ``raised KeyboardInterrupt``,
    ``raised ValueError: ...`` (a completion used as a message list, ``c[0]["content"]`` or
    ``c.get(...)`` on a string, adds :data:`STRINGS_HINT`; a string method on a message list,
    :data:`MESSAGES_HINT`)."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({'' if e.code is None else repr(e.code)})"
    if isinstance(e, KeyboardInterrupt):
        return "raised KeyboardInterrupt"
    out = f"raised {one_line(e)}"
    if isinstance(e, TypeError | AttributeError) and ("string indices" in str(e) or "'str' object" in str(e)):
        out += f" ({STRINGS_HINT})"
    elif isinstance(e, TypeError | AttributeError) and any(
        k in str(e) for k in ("'list' object", "not list", "got 'list'")
    ):
        out += f" ({MESSAGES_HINT})"
    return out


def is_conversation(prompt: Any) -> bool:
    """TRL's ``is_conversational`` for one prompt value: a non-empty list of ``{"role", ...}`` dicts."""
    return (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and all(isinstance(m, dict) and "role" in m for m in prompt)
    )


def as_completions(prompts: Sequence[Any], texts: Sequence[str], form: str) -> list[Any]:
    """The ``completions`` argument for ``texts`` answering ``prompts`` (module docstring): the text,
    or TRL's ``[{"role": "assistant", "content": text}]`` where ``form`` is ``messages``, or ``auto``
    and the prompt is a conversation."""
    if form not in COMPLETION_FORMS:
        raise RewardLoadError(f"reward completions {form!r}: expected one of {', '.join(COMPLETION_FORMS)}")
    msgs = [form == "messages" or (form == "auto" and is_conversation(p)) for p in prompts]
    return [[{"role": "assistant", "content": t}] if m else t for t, m in zip(texts, msgs, strict=True)]


@contextlib.contextmanager
def user_code() -> Iterator[list[int]]:
    """Around a call of the user's code: the SIGINTs that arrived meanwhile (on the main thread,
    the SIGINT handler is wrapped to count them and then does what it did). A ``KeyboardInterrupt``
    with none counted is the code's own, so its failure; with one counted, the user's Ctrl-C."""
    seen: list[int] = []
    prev = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if prev is None:  # another thread (Python signals never interrupt it), or a handler not set from Python
        yield seen
        return

    def handler(signum: int, frame: Any) -> None:
        seen.append(signum)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, prev)


def _passed_on(e: BaseException, seen: list[int]) -> bool:
    """Whether ``e`` is the user's Ctrl-C rather than the code's failure (:func:`user_code`)."""
    return isinstance(e, KeyboardInterrupt) and bool(seen)


def check_signature(fn: Callable, name: str, columns: Sequence[str] | None = None) -> None:
    """``fn`` can be called as klrl calls it, with keywords (TRL's ``reward_funcs`` convention):
    it takes ``completions`` by name (or ``**kwargs``), and every argument it requires is passed
    (``prompts``, ``completions``, ``completion_ids`` and, when ``columns`` is known, the prompt
    data's columns). :class:`RewardLoadError` (one line) otherwise."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call tells
    kinds = inspect.Parameter
    if any(p.kind is kinds.VAR_KEYWORD for p in params):
        by_name = None
    else:
        by_name = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    have = (*PASSED, *(columns or ()))
    call = "fn(prompts=[...], completions=[str, ...], completion_ids=[...], **columns) as TRL does"
    if by_name is not None and "completions" not in by_name:
        raise RewardLoadError(
            f"reward function {name}: takes no 'completions' argument by name (its signature: "
            f"{_sig(fn)}); klrl calls {call}"
        )
    for p in params:
        required = p.default is kinds.empty and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        if required and p.kind is kinds.POSITIONAL_ONLY:
            raise RewardLoadError(
                f"reward function {name}: argument {p.name!r} is positional-only (its signature: "
                f"{_sig(fn)}); klrl calls {call}"
            )
        if required and columns is not None and p.name not in have:
            cols = ", ".join(columns) or "none"
            raise RewardLoadError(
                f"reward function {name}: requires argument {p.name!r}, which klrl does not pass "
                f"(it passes prompts, completions, completion_ids and the prompt data's columns: {cols})"
            )


def _finite32(x: np.ndarray) -> np.ndarray:
    """Whether each value is finite in float32 (NaN, inf and ``|x| > 3.4e38`` are not)."""
    return np.isfinite(x) & (np.abs(x) <= F32_MAX)


def _sig(fn: Callable) -> str:
    return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"


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
        name = f"klrl_reward_{path.stem}_{abs(hash(str(path.resolve())))}"
        with user_code() as seen:
            try:
                mod_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(mod_spec)
                sys.modules[name] = module  # as `import` does: dataclasses and pickle look the module up
                mod_spec.loader.exec_module(module)
            except BaseException as e:  # sys.exit() or KeyboardInterrupt at import: the module's doing
                sys.modules.pop(name, None)
                if _passed_on(e, seen):
                    raise
                raise RewardLoadError(f"reward {spec!r}: {path} does not import ({_at_import(e)})") from None
    else:
        with user_code() as seen:
            try:
                module = importlib.import_module(where)
            except BaseException as e:
                if _passed_on(e, seen):
                    raise
                raise RewardLoadError(
                    f"reward {spec!r}: module {where} does not import ({_at_import(e)})"
                ) from None
    if not hasattr(module, attr):
        raise RewardLoadError(f"reward {spec!r}: {where} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardLoadError(f"reward {spec!r}: {attr} is a {type(fn).__name__}, not callable")
    check_signature(fn, spec)
    return fn


def _at_import(e: BaseException) -> str:
    """An import failure, on one line: ``ModuleNotFoundError: ...``, ``it called sys.exit(5)``."""
    return one_line(e) if isinstance(e, Exception) else f"it {describe(e)}"


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
        timeout: float | None = None,
        completions: str = "auto",
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
        as_completions(
            self.prompts[:1], [""] * min(1, len(self.prompts)), completions
        )  # a bad form: one line
        self.completions = completions
        self.columns = {k: list(v) for k, v in (columns or {}).items()}
        for k, v in self.columns.items():
            if len(v) != len(self.prompts):
                raise RewardLoadError(f"reward column {k!r}: {len(v)} values for {len(self.prompts)} prompts")
        for n, f in zip(self.names, self.fns, strict=True):
            check_signature(f, n, tuple(self.columns))
        self._accepts = tuple(_accepted(f) for f in self.fns)
        self._stops = frozenset(int(s) for s in tokenizer.stop_ids)
        # a training run's mode: once a function failed, every row of that call and of every later call
        # is an error (ABORTED where nothing else went wrong), so no later iteration is accepted
        self.stop_after_error = stop_after_error
        self.timeout = timeout or None  # seconds a call may take (reward.timeout; None or 0: no limit)
        self._lock = threading.RLock()  # device shards call back from several threads: one at a time
        self.errors: list[str] = []  # the first MAX_MESSAGES problems, in the order they happened
        self.n_errors = 0
        self.n_all_none = 0
        self.all_none_calls = 0  # consecutive calls in which no completion got a number (ALL_NONE_LIMIT)
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
        kwargs = self._kwargs(idx, [d[0] for d in decoded], [d[1] for d in decoded])
        at = lambda i: i if len(lead) == 1 else tuple(int(x) for x in np.unravel_index(i, lead))
        values = np.full((m, f), np.nan)
        error = np.zeros(m, dtype=np.int32)
        for j in range(f):
            values[:, j], codes, problems = self._call(j, kwargs, idx, at)
            for p in problems:
                self._record(j, p)
            error[:] = np.where(error == OK, codes, error)
        scores = np.nansum(values * self.weights, axis=1)
        over = (error == OK) & ~_finite32(scores)
        for i in np.flatnonzero(over)[:1]:
            self._record(None, self._overflow(values[i], scores[i], at(i)))
        error[over] = NOT_FINITE
        if self.stop_after_error and (error != OK).any():
            error[:] = np.where(error == OK, ABORTED, error)
        none = np.isnan(values).all(axis=1) & (error == OK)
        self._no_score(none, error)
        scores = np.where(error == OK, scores, 0.0)
        self.n_calls += 1
        self.n_all_none += int(none.sum())
        return (
            scores.astype(np.float32).reshape(lead),
            values.astype(np.float32).reshape(*lead, f),
            error.reshape(lead),
        )

    def _no_score(self, none: np.ndarray, error: np.ndarray) -> None:
        """Count a call whose every completion got ``None`` from every function; the
        :data:`ALL_NONE_LIMIT`-th in a row (a training run's mode) is an error on every row."""
        self.all_none_calls = self.all_none_calls + 1 if none.size and none.all() else 0
        if self.stop_after_error and self.all_none_calls >= ALL_NONE_LIMIT:
            which = ", ".join(self.names)
            self._record(
                None,
                f"reward function{'s' if len(self.names) > 1 else ''} {which}: returned None for every "
                f"completion of {self.all_none_calls} consecutive batches ({none.size} completions in the "
                "last): no task reward to learn from (None means 'no opinion'; return a number)",
            )
            error[:] = NO_SCORE

    def _kwargs(self, idx: np.ndarray, completions: list[str], ids: list[list[int]]) -> dict[str, Any]:
        prompts = [self.prompts[i] for i in idx]
        return {
            "prompts": prompts,
            "completions": as_completions(prompts, completions, self.completions),
            "completion_ids": ids,
            **{k: [v[i] for i in idx] for k, v in self.columns.items()},
        }

    def _call(self, j: int, kwargs: dict[str, Any], idx: np.ndarray, at: Callable[[int], Any]):
        """Function ``j`` on ``kwargs`` (the keywords it takes): ``(values [m] float64, NaN where
        None or failed; codes [m]; problems)``. Whatever it raises is its failure (module docstring);
        each value must be a number, finite in float32."""
        m = len(idx)
        values, codes, problems = np.full(m, np.nan), np.zeros(m, np.int32), []
        acc = self._accepts[j]
        kw = kwargs if acc is None else {k: v for k, v in kwargs.items() if k in acc}
        with user_code() as seen:
            try:
                out = self._invoke(j, kw)
            except _TimedOut:
                why = f"did not return within {self.timeout:g} s (reward.timeout; its call is left running)"
                return values, np.full(m, TIMED_OUT, np.int32), [why]
            except BaseException as e:  # noqa: BLE001  (sys.exit(), KeyboardInterrupt: its failure too)
                if _passed_on(e, seen):
                    raise
                return values, np.full(m, RAISED, np.int32), [describe(e)]
        if not isinstance(out, Sequence | np.ndarray) or isinstance(out, str | bytes):
            return (
                values,
                np.full(m, WRONG_TYPE, np.int32),
                [f"returned a {type(out).__name__}, not a list of {m} values"],
            )
        if len(out) != m:
            return (
                values,
                np.full(m, WRONG_COUNT, np.int32),
                [f"returned {len(out)} values for {m} completions"],
            )
        for i, v in enumerate(out):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                problems.append(f"returned a {type(v).__name__} for completion {at(i)}, not a number")
                codes[i] = WRONG_TYPE
                continue
            x = float(v)
            if not math.isfinite(x) or abs(x) > F32_MAX:
                f32 = "" if not math.isfinite(x) else " (inf in float32, whose largest value is 3.4e+38)"
                problems.append(f"returned {x:g} for completion {at(i)} (prompt row {int(idx[i])}){f32}")
                codes[i] = NOT_FINITE
            else:
                values[i] = x
        return values, codes, problems

    def _invoke(self, j: int, kw: dict[str, Any]) -> Any:
        """``fns[j](**kw)``; with a ``timeout``, on a daemon thread waited for that long: a call that
        has not returned raises :class:`_TimedOut`. Python cannot stop a thread, so a hung call is left
        running (daemon: it does not keep the process alive; the run ends through the failure path and
        the process exits with it). What the function raises is re-raised here; a Ctrl-C during the
        wait reaches this (the main) thread as before (:func:`user_code`)."""
        if self.timeout is None:
            return self.fns[j](**kw)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = self.fns[j](**kw)
            except BaseException as e:  # noqa: BLE001  (re-raised on the caller's thread)
                box["raised"] = e

        t = threading.Thread(target=target, name=f"klrl-reward-{self.names[j]}", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            raise _TimedOut
        if "raised" in box:
            raise box["raised"]
        return box["out"]

    def _overflow(self, values: np.ndarray, score: float, where: Any) -> str:
        used = [
            (n, w, v) for n, w, v in zip(self.names, self.weights, values, strict=True) if not math.isnan(v)
        ]
        terms = " + ".join(f"{w:g} * {v:g} ({n})" for n, w, v in used)
        return (
            f"reward functions: the weighted sum {terms} = {score:g} for completion {where} is not "
            "finite in float32 (largest 3.4e+38)"
        )

    def probe(self, prompt_idx: Sequence[int], completions: Sequence[str]) -> None:
        """Call every function once as a training call would, on the pool rows ``prompt_idx`` with
        ``completions`` (strings); :class:`RewardFunctionError` (one line) with the first problem:
        it raised (or exited), returned the wrong number or type of values, or a value not finite in
        float32. Nothing is recorded: the run starts with a clean registry."""
        idx = np.asarray(prompt_idx, np.int64).reshape(-1)
        comps = [str(c) for c in completions]
        ids = [self.tokenizer.encode(c) for c in comps]
        kwargs = self._kwargs(idx, comps, ids)
        values = np.full((len(idx), len(self.fns)), np.nan)
        with self._lock:
            for j in range(len(self.fns)):
                values[:, j], _, problems = self._call(j, kwargs, idx, lambda i: i)
                if problems:
                    note = self._form_note(kwargs["completions"], problems[0])
                    raise RewardFunctionError(
                        f"reward function {self.names[j]}: {problems[0]} (a call before compiling, on "
                        f"{len(idx)} prompt(s) with their own text as the completions{note})"
                    )
        scores = np.nansum(values * self.weights, axis=1)
        bad = np.flatnonzero(~_finite32(scores))
        if bad.size:
            raise RewardFunctionError(self._overflow(values[bad[0]], scores[bad[0]], int(bad[0])))

    @staticmethod
    def _form_note(completions: list[Any], problem: str) -> str:
        """What the completions were, for a probe's failure (nothing where its hint says it)."""
        if STRINGS_HINT in problem or MESSAGES_HINT in problem:
            return ""
        if all(isinstance(c, str) for c in completions):
            return "; completions are plain strings"
        return "; completions are TRL message lists [{'role': 'assistant', 'content': text}]"

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

    def with_all_none(self, prompt_idx: jax.Array, response: jax.Array, mask: jax.Array):
        """``(scores, error, all_none)``: ``all_none`` ``[B]`` float32 is 1 where every function returned
        ``None`` for the completion (it scores 0.0; ``reward/all_none_frac`` is its batch mean)."""
        scores, values, error = self.components(prompt_idx, response, mask)
        all_none = jnp.all(jnp.isnan(values), axis=-1) & (error == OK)
        return scores, error, all_none.astype(jnp.float32)

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
            self.all_none_calls = 0


# a HostReward over the pool ``prompts`` (``prompt_idx`` indexes it) and ``columns``: ``timeout`` the seconds
# a call may take (None: no limit), ``completions`` the form of the functions' completions (module docstring)
make_host_reward = HostReward

"""Built-in text rewards with TRL's ``reward_funcs`` signature, registered in
:data:`klrl.registry.REWARDS`.

Each is ``fn(prompts, completions, **columns) -> list[float | None]`` (one value per completion;
``None``: no opinion, skipped in the weighted sum, as TRL does). A completion may be the text or
TRL's conversational ``[{"role": "assistant", "content": text}]`` (:func:`completion_text` reads
either; klrl.rewards.host says which it gets). ``get(name, **params)`` returns
one by name: ``positivity``, ``length`` (``target``, ``unit``), ``arithmetic``. A reward is
registered as the function itself, or (``factory=True``) as a function of its parameters that
returns one (``length``).

- ``positivity``: a lexicon score, ``(n_pos - n_neg) / sqrt(max(n_words, 1))`` over lower-cased
  words; a polar word within two words after a negator ("not", "never", "isn't", ...) counts with
  the other sign. The square root keeps a long list of positive words from scoring linearly in
  its length while a longer text of the same tone still scores a little higher. The lexicon is
  hand-written for klrl; the count of positive minus negative words is the usual lexicon score,
  and its length normalisation is klrl's choice.
- ``length``: ``-|n - target| / target`` with ``n`` the completion's words (or characters).
- ``arithmetic``: a verifier for GRPO-style runs: 1.0 if the last number in the completion equals
  the row's ``answer`` column, else 0.0; ``None`` where the row has no answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from klrl.registry import REWARDS

RewardFn = Callable[..., list[float | None]]

POSITIVE = frozenset(
    """good great excellent wonderful lovely nice happy joy joyful glad delighted pleasant beautiful
    amazing awesome fantastic brilliant superb marvellous marvelous fine calm peaceful cheerful bright
    warm kind friendly gentle helpful generous love loved loving like liked enjoy enjoyed enjoyable fun
    perfect best better charming delightful fresh clean cozy cosy comfortable relaxing relaxed hope
    hopeful grateful thankful thanks proud exciting excited inspiring impressive elegant smooth tasty
    delicious sweet sunny gorgeous pretty safe easy success successful win winning welcome favourite
    favorite positive glorious splendid terrific thrilled satisfied satisfying vibrant magical""".split()
)

NEGATIVE = frozenset(
    """bad terrible awful horrible poor sad unhappy angry upset miserable unpleasant ugly boring dull
    annoying annoyed hate hated hateful dislike disliked worst worse nasty dirty cold cruel rude mean
    painful pain hurt broken fail failed failure wrong problem problems difficult hard slow noisy
    crowded tired tiring stressful stress worried worry fear afraid scary dangerous lonely lost grim
    gloomy dreadful disappointing disappointed disgusting sick bitter harsh tense sorry regret loss
    negative tragic depressing frustrating frustrated messy useless lousy mediocre weak dark damp
    rotten stale hopeless""".split()
)

NEGATORS = frozenset(
    """not no never none nobody nothing hardly barely isn't wasn't aren't weren't don't doesn't didn't
    can't cannot couldn't won't wouldn't shouldn't""".split()
)

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def words(text: str) -> list[str]:
    """Lower-cased words (letters with an optional apostrophe part: "isn't")."""
    return _WORD.findall(text.lower())


def positivity_score(text: str) -> float:
    """``(n_pos - n_neg) / sqrt(max(n_words, 1))``, a polar word flipped within 2 words after a negator."""
    ws = words(text)
    total = 0
    for i, w in enumerate(ws):
        sign = 1 if w in POSITIVE else -1 if w in NEGATIVE else 0
        if sign and any(x in NEGATORS for x in ws[max(0, i - 2) : i]):
            sign = -sign
        total += sign
    return total / math.sqrt(max(len(ws), 1))


def completion_text(c: Any) -> str:
    """The text of one completion: a string as it is, or the last message's ``content`` of TRL's
    conversational form ``[{"role": "assistant", "content": text}]``."""
    if isinstance(c, str):
        return c
    if (
        isinstance(c, list | tuple)
        and c
        and isinstance(c[-1], dict)
        and isinstance(c[-1].get("content"), str)
    ):
        return c[-1]["content"]
    raise TypeError(
        f"a completion is a string or a list of {{role, content}} messages, not {type(c).__name__}"
    )


@REWARDS.register("positivity")
def positivity(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """The lexicon positivity of each completion (see the module docstring)."""
    return [positivity_score(completion_text(c)) for c in completions]


@REWARDS.register("length")
def length_target(target: float = 20.0, unit: str = "words") -> RewardFn:
    """A reward ``-|n - target| / target``, ``n`` the completion's length in ``unit`` (words or chars)."""
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"length reward: target must be > 0 (got {target})")
    if unit not in ("words", "chars"):
        raise ValueError(f"length reward: unit must be 'words' or 'chars' (got {unit!r})")

    def length(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        texts = [completion_text(c) for c in completions]
        n = [len(c.split()) if unit == "words" else len(c) for c in texts]
        return [-abs(k - target) / target for k in n]

    length.__qualname__ = f"length_target(target={target}, unit={unit!r})"
    return length


def last_number(text: str) -> float | None:
    """The last number written in ``text`` ("1,234" is 1234; "-8" is negative), None if there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def _as_number(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        return float(str(x).replace(",", "").strip())
    except ValueError:
        return None


@REWARDS.register("arithmetic")
def arithmetic(
    prompts: list[Any], completions: list[Any], answer: list[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 where the completion's last number equals ``answer``, 0.0 otherwise, None without an answer."""
    if answer is None:
        raise ValueError("needs an 'answer' column in the prompt data")
    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        want = _as_number(a)
        got = last_number(completion_text(c))
        out.append(None if want is None else float(got is not None and abs(got - want) < 1e-9))
    return out


def names() -> tuple[str, ...]:
    """The built-in rewards' names (:data:`klrl.registry.REWARDS`)."""
    return REWARDS.names()


def get(name: str, **params: Any) -> RewardFn:
    """The built-in reward ``name`` (``params`` for the parametrised ones, e.g. ``length``'s target);
    ``KeyError`` naming the built-ins for an unknown name."""
    if name not in REWARDS:
        raise KeyError(f"no built-in reward {name!r} (built-in: {', '.join(REWARDS.names())})")
    fn, meta = REWARDS.entry(name)
    if meta.get("factory"):
        return fn(**params)
    if params:
        raise TypeError(f"built-in reward {name!r} takes no parameters (got {', '.join(params)})")
    return fn

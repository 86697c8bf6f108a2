"""Built-in text rewards against hand-computed values, and their registry."""

from __future__ import annotations

import math

import pytest

from klrl.registry import REWARDS
from klrl.rewards import text
from klrl.rewards.text import NEGATIVE, NEGATORS, POSITIVE, arithmetic, get, last_number, positivity


@pytest.mark.parametrize(
    "completion, want",
    [
        ("good", 1.0),
        ("This is good and great", 2 / math.sqrt(5)),
        ("A bad day.", -1 / math.sqrt(3)),
        ("not good", -1 / math.sqrt(2)),
        ("It was not very good", -1 / math.sqrt(5)),  # a negator two words before still flips
        ("It isn't bad at all", 1 / math.sqrt(5)),
        ("not the , really , good one", 1 / math.sqrt(5)),  # three words away: no flip
        ("GOOD! Wonderful; awful.", 1 / math.sqrt(3)),
        ("", 0.0),
        ("the cat sat on the mat", 0.0),
    ],
)
def test_positivity_hand_values(completion, want) -> None:
    assert positivity(["p"], [completion]) == [pytest.approx(want, abs=1e-12)]


def test_positivity_orders_tone_and_lexicons_are_disjoint() -> None:
    s = positivity(
        [""] * 3,
        ["What a lovely, wonderful day", "It was an ordinary day", "What a terrible, awful day"],
    )
    assert s[0] > 0 == s[1] > s[2]
    assert not POSITIVE & NEGATIVE and not (POSITIVE | NEGATIVE) & NEGATORS
    assert len(POSITIVE) >= 80 and len(NEGATIVE) >= 80


def test_length_target() -> None:
    fn = get("length", target=4)
    assert fn(["p"] * 4, ["a b c d", "a b", "a b c d e f", ""]) == [0.0, -0.5, -0.5, -1.0]
    chars = get("length", target=10, unit="chars")
    assert chars(["p", "p"], ["x" * 10, "x" * 15]) == [0.0, -0.5]
    assert get("length")(["p"], [" ".join(["w"] * 20)]) == [0.0]  # default target 20 words
    with pytest.raises(ValueError, match="target must be > 0"):
        get("length", target=0)
    with pytest.raises(ValueError, match="unit must be"):
        get("length", unit="tokens")


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is 42.", 42.0),
        ("17 + 25 = 42", 42.0),
        ("first 3 then -8", -8.0),
        ("about 1,234 apples", 1234.0),
        ("pi is 3.14", 3.14),
        ("no number here", None),
    ],
)
def test_last_number(text, want) -> None:
    assert last_number(text) == want


def test_arithmetic_verifier() -> None:
    completions = ["The answer is 42.", "17 + 25 = 41", "I do not know", "It is 42", "= -8", "42"]
    answers = [42, 42, 42, "42", -8, None]
    assert arithmetic([""] * 6, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, None]
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        arithmetic(["x"], ["1"])


def test_registry() -> None:
    assert text.names() == REWARDS.names() and "positivity" in REWARDS
    assert get("positivity") is positivity and get("arithmetic") is arithmetic
    assert get("length", target=5.0)([""], ["a b c d e"]) == [0.0]  # factory=True: built from its params
    for name in REWARDS:  # each built-in is a TRL-style reward function (or builds one)
        fn = get(name)
        assert len(fn(["p", "q"], ["1 good", "bad 2"], answer=[1, 2])) == 2
    with pytest.raises(TypeError, match="built-in reward 'positivity' takes no parameters"):
        get("positivity", target=3)
    with pytest.raises(
        KeyError, match=f"no built-in reward 'sentiment' \\(built-in: {', '.join(REWARDS)}\\)"
    ):
        get("sentiment")

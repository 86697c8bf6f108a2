"""klrl.eval.gold: the gold's parts by hand; the relevance penalty's hinge; VADER's direction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from klrl.eval import gold

FREE = {"nll_free": 3.0, "pmi_free": 0.5}


def test_gold_is_its_parts_as_the_formula_writes_them():
    text = "good good day"  # words: good, good, day: 1 of 3 repeats
    parts = gold.gold_parts(text, nll=4.0, pmi=0.2, free=FREE)
    s = gold.sentiment(text)
    assert parts["repeated"] == pytest.approx(1 / 3)
    assert parts["fluency_pen"] == pytest.approx(0.5 * (4.0 - 3.0))
    assert parts["relevance_pen"] == pytest.approx(2.0 * (1 - 0.2 / 0.5))
    assert parts["gold"] == pytest.approx(s - 1 / 3 - 0.5 - 1.2)
    assert parts["relevance"] == 0.2 and parts["judge_nll"] == 4.0


@pytest.mark.parametrize("pmi, pen", [(-0.3, 3.2), (0.0, 2.0), (0.25, 1.0), (0.5, 0.0), (2.0, 0.0)])
def test_relevance_penalty_is_a_hinge_at_the_reference_median(pmi, pen):
    assert gold.gold_parts("fine", 3.0, pmi, FREE)["relevance_pen"] == pytest.approx(pen)


def test_an_empty_response_has_no_relevance_and_no_fluency_penalty():
    parts = gold.gold_parts("", float("nan"), float("nan"), FREE)
    assert parts["relevance_pen"] == 2.0 and parts["fluency_pen"] == 0.0 and parts["sentiment"] == 0.0


def test_vader_reads_negation_intensifiers_and_punctuation():
    s = gold.sentiment
    assert s("This is good.") > 0 > s("This is not good.")
    assert s("This is very good!") > s("This is good.")  # an intensifier and an exclamation mark
    assert s("The road is long.") == 0.0 and -1 <= s("horrible awful terrible") < -0.5


def test_calibrate_takes_the_reference_medians_and_refuses_a_blind_judge():
    free = gold.calibrate([1.0, 2.0, np.nan, 9.0], [0.1, 0.3, 0.2, np.nan])
    assert free == {"nll_free": 2.0, "pmi_free": pytest.approx(0.2)}
    with pytest.raises(ValueError, match="median relevance"):
        gold.calibrate([1.0], [-0.1])
    assert math.isfinite(gold.score(["a"], [2.0], [0.2], free)[0]["gold"])

"""Host-side text rewards behind ``jax.pure_callback``: loading, the weighted TRL sum, the three
failure modes (raise, NaN, wrong count) and a wrong type, under ``jit``, ``vmap`` and ``shard_map``.

The reference scores are computed here by calling the reward functions on the completion
*strings* (the callback has to decode them from token ids) and summing in a Python loop.
``shard_map`` runs in a subprocess with 4 forced host devices (as tests/config/test_sweep.py does).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from texttok import make_tokenizer

from klrl.rewards import RewardFunctionError, RewardLoadError, load_reward_fn, make_host_reward, parse_specs
from klrl.rewards.host import NO_SCORE, NOT_FINITE, RAISED, WRONG_COUNT, WRONG_TYPE
from klrl.rewards.text import arithmetic, positivity

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
HERE = Path(__file__).resolve().parent  # this module

PROMPTS = ["What is 17 + 25?", "Say something nice.", "What is 3 * 4?", "Describe the rain."]
COLUMNS = {"answer": [42, None, 12, None], "topic": ["maths", "chat", "maths", "weather"]}
COMPLETIONS = [
    "The answer is 42.",
    "You are wonderful and kind.",
    "It is 13, not good",
    "The rain was awful and cold.",
    "42",
    "hello",
    "3 * 4 = 12, great!",
    "",
]
IDX = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32)
R = 20
WEIGHTS = (1.0, 2.0)

REWARD_FILE = """
import math

def short(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)

def boom(completions):
    raise ValueError("boom")

def nan_at_1(completions, **kw):
    return [math.nan if i == 1 else 1.0 for i in range(len(completions))]

def strings(completions, **kw):
    return ["high"] * len(completions)

def topic_len(completions, topic):
    return [float(len(t)) for t in topic]

NOT_A_FUNCTION = 3

import dataclasses

@dataclasses.dataclass
class Scale:  # a dataclass in a file loaded by path (needs the module in sys.modules)
    k: float = 2.0

    def __call__(self, completions, **kw):
        return [self.k] * len(completions)

scaled = Scale()

def multiline(completions):
    raise RuntimeError("first line\\nsecond line")
"""


def encode_batch(tok, completions, r=R):
    """Token ids + stop id, left-aligned; the rest is junk under mask 0 (the callback must skip it)."""
    resp = np.full((len(completions), r), 300, np.int32)
    mask = np.zeros((len(completions), r), np.float32)
    for i, c in enumerate(completions):
        ids = tok.encode(c) + [tok.stop_ids[1]]
        assert len(ids) <= r
        resp[i, : len(ids)], mask[i, : len(ids)] = ids, 1.0
    return resp, mask


def reference(completions, idx, weights=WEIGHTS):
    pos = positivity([PROMPTS[i] for i in idx], completions)
    ver = arithmetic([PROMPTS[i] for i in idx], completions, answer=[COLUMNS["answer"][i] for i in idx])
    out = []
    for p, v in zip(pos, ver, strict=True):
        s = weights[0] * p
        if v is not None:
            s += weights[1] * v
        out.append(s)
    return np.array(out, np.float32), np.array([pos, [math.nan if v is None else v for v in ver]]).T


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def rfile(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return str(path)


@pytest.fixture(scope="module")
def batch(tok):
    return encode_batch(tok, COMPLETIONS)


# ---- loading ------------------------------------------------------------------------------------


def test_load_specs(rfile, tmp_path) -> None:
    assert load_reward_fn("positivity") is positivity
    assert load_reward_fn("klrl.rewards.text:arithmetic") is arithmetic
    assert load_reward_fn(f"{rfile}:short")(["a"], ["a", "b"]) == [0.0]
    assert parse_specs(" positivity, x.py:f ", "1, 0.5") == (["positivity", "x.py:f"], [1.0, 0.5])
    assert parse_specs("positivity") == (["positivity"], None)
    (tmp_path / "broken.py").write_text("import no_such_module_klrl\n")
    cases = [
        ("sentiment", r"reward 'sentiment': no built-in reward 'sentiment'"),
        ("nowhere/r.py:f", r"reward 'nowhere/r.py:f': file nowhere/r.py not found"),
        (f"{tmp_path}/broken.py:f", r"broken.py does not import \(ModuleNotFoundError: No module named"),
        ("no_such_module_klrl:f", r"module no_such_module_klrl does not import \(ModuleNotFoundError"),
        (f"{rfile}:missing", r"my_rewards.py has no attribute 'missing'"),
        (f"{rfile}:NOT_A_FUNCTION", r"NOT_A_FUNCTION is a int, not callable"),
        ("klrl.rewards.text:", r"expected module:function"),
    ]
    for spec, msg in cases:
        with pytest.raises(RewardLoadError, match=msg) as e:
            load_reward_fn(spec)
        assert "\n" not in str(e.value)
    with pytest.raises(RewardLoadError, match="expected comma-separated numbers"):
        parse_specs("positivity", "1,x")


def test_construction_errors(tok) -> None:
    with pytest.raises(RewardLoadError, match="2 weights for 1 reward functions"):
        make_host_reward(["positivity"], [1.0, 2.0], tok, PROMPTS)
    with pytest.raises(RewardLoadError, match="must be finite"):
        make_host_reward(["positivity"], [math.inf], tok, PROMPTS)
    with pytest.raises(RewardLoadError, match="column 'answer': 3 values for 4 prompts"):
        make_host_reward(["positivity"], None, tok, PROMPTS, {"answer": [1, 2, 3]})
    with pytest.raises(RewardLoadError, match="not callable"):
        make_host_reward([3], None, tok, PROMPTS)


# ---- the happy path -----------------------------------------------------------------------------


def test_jit_matches_the_reference_and_decodes_exactly(tok, batch) -> None:
    seen = {}

    def record(prompts, completions, completion_ids, topic):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, topic=topic)
        return [None] * len(completions)  # no opinion: does not change the sum

    resp, mask = batch
    rw = make_host_reward(["positivity", "arithmetic", record], [*WEIGHTS, 5.0], tok, PROMPTS, COLUMNS)
    scores, error = jax.jit(rw)(jnp.asarray(IDX), jnp.asarray(resp), jnp.asarray(mask))
    want, parts = reference(COMPLETIONS, IDX)
    np.testing.assert_allclose(np.asarray(scores), want, rtol=1e-6, atol=1e-6)
    assert np.asarray(error).dtype == np.int32 and not np.asarray(error).any()
    rw.check(error)
    assert seen["completions"] == COMPLETIONS  # exact decode; junk after the mask and the stop id dropped
    assert seen["prompts"] == [PROMPTS[i] for i in IDX]
    assert seen["topic"] == [COLUMNS["topic"][i] for i in IDX]
    assert seen["ids"][0] == tok.encode(COMPLETIONS[0])
    _, per_fn, _ = jax.jit(rw.components)(IDX, resp, mask)
    np.testing.assert_allclose(np.asarray(per_fn)[:, :2], parts, rtol=1e-6)
    assert np.isnan(np.asarray(per_fn)[:, 2]).all()
    assert rw.n_all_none == 0


def test_all_none_scores_zero_and_is_counted(tok, batch) -> None:
    resp, mask = batch
    rw = make_host_reward(["arithmetic"], None, tok, PROMPTS, COLUMNS)
    scores, error = rw.score_numpy(IDX, resp, mask)[::2]
    ans = [COLUMNS["answer"][i] for i in IDX]
    assert [s for s, a in zip(scores, ans, strict=True) if a is None] == [0.0] * 4
    assert rw.n_all_none == 4 and not error.any()
    _, _, flags = jax.jit(rw.with_all_none)(IDX, resp, mask)  # what reward/all_none_frac averages
    assert np.asarray(flags).tolist() == [float(a is None) for a in ans]


def test_batches_with_no_score_at_all_end_a_training_run_at_the_third(tok, batch) -> None:
    """A batch where every completion got None counts; one with a number resets the count; the third in
    a row is an error on every row (a training run's mode only), raised by check naming the functions."""
    resp, mask = batch
    state = {"none": True}

    def maybe(completions):
        return [None if state["none"] else 1.0] * len(completions)

    def silent(completions):
        return [None] * len(completions)

    for stop in (False, True):
        rw = make_host_reward([maybe, silent], None, tok, PROMPTS, stop_after_error=stop)
        for none in (True, True, False, True, True):  # a scored batch in between: no stop
            state["none"] = none
            assert not rw.score_numpy(IDX, resp, mask)[2].any()
        state["none"] = True
        error = rw.score_numpy(IDX, resp, mask)[2]  # the third in a row
        if not stop:
            assert not error.any() and rw.all_none_calls == 3
            rw.check()
            continue
        assert (error == NO_SCORE).all()
        with pytest.raises(
            RewardFunctionError,
            match=r"^reward functions \S+maybe, \S+silent: returned None "
            r"for every completion of 3 consecutive batches \(8 completions in the last\)",
        ):
            rw.check()


def test_vmap_is_one_host_call_for_the_whole_sweep(tok) -> None:
    members = [COMPLETIONS, COMPLETIONS[::-1], ["good"] * 8]
    enc = [encode_batch(tok, c) for c in members]
    resp, mask = np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc])
    rw = make_host_reward(["positivity", "arithmetic"], WEIGHTS, tok, PROMPTS, COLUMNS)
    scores, error = jax.jit(jax.vmap(rw, in_axes=(None, 0, 0)))(IDX, resp, mask)
    assert np.asarray(scores).shape == (3, 8) and rw.n_calls == 1
    for s, c in zip(np.asarray(scores), members, strict=True):
        np.testing.assert_allclose(s, reference(c, IDX)[0], rtol=1e-6, atol=1e-6)
    idx2 = np.stack([IDX, IDX[::-1], IDX])
    scores2, _ = jax.jit(jax.vmap(rw))(idx2, resp, mask)
    for s, c, i in zip(np.asarray(scores2), members, idx2, strict=True):
        np.testing.assert_allclose(s, reference(c, i)[0], rtol=1e-6, atol=1e-6)
    rw.check(error)


# ---- failures -----------------------------------------------------------------------------------

FAILURES = {
    "short": (WRONG_COUNT, "all", r"reward function {f}:short: returned 7 values for 8 completions$"),
    "boom": (RAISED, "all", r"reward function {f}:boom: raised ValueError: boom$"),
    "nan_at_1": (
        NOT_FINITE,
        [1],
        r"reward function {f}:nan_at_1: returned nan for completion 1 \(prompt row 1\)",
    ),
    "strings": (
        WRONG_TYPE,
        "all",
        r"reward function {f}:strings: returned a str for completion 0, not a number",
    ),
}


def _expect(name: str, rfile: str, scores, error, rw, sweep: bool = False) -> None:
    code, rows, msg = FAILURES[name]
    if sweep:  # the host call saw both members' 16 completions, indexed (member, row)
        msg = msg.replace("7 values for 8", "15 values for 16").replace(
            "completion 1", r"completion \(0, 1\)"
        )
        msg = msg.replace("completion 0", r"completion \(0, 0\)")
    error, scores = np.asarray(error), np.asarray(scores)
    bad = np.arange(8) if rows == "all" else np.array(rows)
    assert (error[bad] == code).all() and (np.delete(error, bad) == 0).all(), error
    good = np.setdiff1d(np.arange(8), bad)
    want = reference(COMPLETIONS, IDX, (1.0, 0.0))[0]
    np.testing.assert_allclose(scores[good], want[good] + (1.0 if name == "nan_at_1" else 0.0), rtol=1e-6)
    assert (scores[bad] == 0.0).all()
    import re

    with pytest.raises(RewardFunctionError, match=msg.format(f=re.escape(rfile))) as e:
        rw.check(error)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(FAILURES))
@pytest.mark.parametrize("mode", ["jit", "vmap"])
def test_failures_are_recorded_and_raised_by_check(tok, batch, rfile, name, mode) -> None:
    resp, mask = batch
    rw = make_host_reward(["positivity", f"{rfile}:{name}"], None, tok, PROMPTS, COLUMNS)
    if mode == "jit":
        scores, error = jax.jit(rw)(IDX, resp, mask)
    else:  # a sweep of 2 members, one host call
        scores, error = jax.jit(jax.vmap(rw, in_axes=(None, 0, 0)))(
            IDX, np.stack([resp] * 2), np.stack([mask] * 2)
        )
        if name != "nan_at_1":
            assert (np.asarray(error)[0] == np.asarray(error)[1]).all()
        else:  # flat index 1 of the one host call is member 0's row 1
            assert not np.asarray(error)[1].any()
        scores, error = scores[0], error[0]
    _expect(name, rfile, scores, error, rw, sweep=mode == "vmap")
    rw.reset()
    rw.check(np.zeros(8, np.int32))  # forgotten after reset


def test_callback_problems_are_recorded_not_raised(tok, batch, rfile) -> None:
    resp, mask = batch
    rw = make_host_reward(["positivity"], None, tok, PROMPTS)
    scores, error = jax.jit(rw)(np.array([0, 1, 2, 3, 4, 0, 0, 0], np.int32), resp, mask)
    assert (np.asarray(error) == RAISED).all() and not np.asarray(scores).any()
    want = (
        r"^reward callback: cannot decode the completions \(IndexError: prompt index 4 outside the pool of 4"
    )
    with pytest.raises(RewardFunctionError, match=want + r" prompts\)$"):
        rw.check(error)
    rw = make_host_reward([f"{rfile}:multiline", f"{rfile}:scaled"], None, tok, PROMPTS)
    with pytest.raises(
        RewardFunctionError, match=r":multiline: raised RuntimeError: first line / second line$"
    ):
        rw.check(jax.jit(rw)(IDX, resp, mask)[1])
    assert (np.asarray(rw.score_numpy(IDX, resp, mask)[1])[:, 1] == 2.0).all()
    nan_all = lambda completions: [math.nan] * len(completions)
    rw = make_host_reward([nan_all], None, tok, PROMPTS)
    rw.score_numpy(np.zeros(64, np.int32), np.repeat(resp[:1], 64, 0), np.repeat(mask[:1], 64, 0))
    assert rw.n_errors == 64 and len(rw.errors) == 32  # the registry is capped
    with pytest.raises(
        RewardFunctionError, match=r"returned nan for completion 0 \(prompt row 0\) \(and 63 more"
    ):
        rw.check()


def test_check_without_the_message_still_raises(tok) -> None:
    rw = make_host_reward(["positivity"], None, tok, PROMPTS)  # its process saw no error
    rw.check()
    with pytest.raises(RewardFunctionError, match="returned the wrong number of values on another process"):
        rw.check(np.array([0, WRONG_COUNT], np.int32))


def test_topic_keyword_only_function_gets_its_column(tok, batch, rfile) -> None:
    resp, mask = batch
    rw = make_host_reward([f"{rfile}:topic_len"], None, tok, PROMPTS, COLUMNS)
    scores, _ = jax.jit(rw)(IDX, resp, mask)
    np.testing.assert_array_equal(np.asarray(scores), [len(COLUMNS["topic"][i]) for i in IDX])


# ---- shard_map on 4 host devices (subprocess) ----------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from texttok import make_tokenizer
    from test_host_reward import COLUMNS, COMPLETIONS, IDX, PROMPTS, WEIGHTS, encode_batch
    from klrl.rewards import RewardFunctionError, make_host_reward

    rfile, out_path = sys.argv[1:3]
    assert jax.device_count() == 4, jax.devices()
    tok = make_tokenizer()
    resp, mask = encode_batch(tok, COMPLETIONS)
    data = Mesh(np.array(jax.devices()), ("data",))
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("sweep", "data"))
    out = {}

    def sharded(rw):
        f = jax.shard_map(rw, mesh=data, in_specs=(P("data"),) * 3, out_specs=(P("data"), P("data")),
                          check_vma=False)
        return jax.jit(f)(IDX, resp, mask)

    rw = make_host_reward(["positivity", "arithmetic"], WEIGHTS, tok, PROMPTS, COLUMNS)
    s, e = sharded(rw)
    rw.check(e)
    out["ok"] = {"scores": np.asarray(s).tolist(), "error": np.asarray(e).tolist(), "calls": rw.n_calls}

    # a sweep of 2 members on a 2 x 2 (sweep x data) mesh: vmap inside shard_map
    f = jax.shard_map(jax.vmap(rw), mesh=grid, in_specs=(P("sweep", "data"),) * 3,
                      out_specs=(P("sweep", "data"),) * 2, check_vma=False)
    s2, e2 = jax.jit(f)(np.stack([IDX, IDX]), np.stack([resp, resp[::-1]]), np.stack([mask, mask[::-1]]))
    rw.check(e2)
    out["sweep"] = {"scores": np.asarray(s2).tolist(), "error": np.asarray(e2).tolist()}

    for name in ["short", "boom", "nan_at_1"]:
        rw = make_host_reward(["positivity", f"{rfile}:{name}"], None, tok, PROMPTS, COLUMNS)
        s, e = sharded(rw)
        try:
            rw.check(e)
            msg = None
        except RewardFunctionError as err:
            msg = str(err)
        out[name] = {"scores": np.asarray(s).tolist(), "error": np.asarray(e).tolist(), "message": msg}
    json.dump(out, open(out_path, "w"))
    """
)


@pytest.fixture(scope="module")
def sharded_results(rfile, tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    (d / "script.py").write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(d / "script.py"), rfile, str(d / "out.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((d / "out.json").read_text())


def test_shard_map_happy_path_and_sweep(sharded_results) -> None:
    ok = sharded_results["ok"]
    np.testing.assert_allclose(ok["scores"], reference(COMPLETIONS, IDX)[0], rtol=1e-6, atol=1e-6)
    assert ok["error"] == [0] * 8 and ok["calls"] == 4  # one call per device shard
    sw = sharded_results["sweep"]
    np.testing.assert_allclose(sw["scores"][0], reference(COMPLETIONS, IDX)[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sw["scores"][1], reference(COMPLETIONS[::-1], IDX)[0], rtol=1e-6, atol=1e-6)
    assert sw["error"] == [[0] * 8] * 2


def test_shard_map_failures(sharded_results, rfile) -> None:
    import re

    r = re.escape(rfile)
    # each device shard has 2 completions: the counts and indices in the message are per shard
    short = sharded_results["short"]
    assert short["error"] == [WRONG_COUNT] * 8 and short["scores"] == [0.0] * 8
    want = rf"reward function {r}:short: returned 1 values for 2 completions \(and 3 more problems\)"
    assert re.fullmatch(want, short["message"])
    boom = sharded_results["boom"]
    assert boom["error"] == [RAISED] * 8
    assert re.match(rf"reward function {r}:boom: raised ValueError: boom", boom["message"])
    nan = sharded_results["nan_at_1"]
    assert nan["error"] == [0, NOT_FINITE] * 4
    assert re.match(
        rf"reward function {r}:nan_at_1: returned nan for completion 1 \(prompt row \d\)", nan["message"]
    )


# ---- the signature, one call before compiling, what a function does -------------------------------


def test_check_signature_names_what_klrl_passes(tok) -> None:
    from klrl.rewards.host import check_signature

    def by_name(prompts, completions):
        return [0.0] * len(completions)

    def kwargs_only(**kw):
        return [0.0] * len(kw["completions"])

    def keyword_only(*, completions, answer=None):
        return [0.0] * len(completions)

    for fn in (by_name, kwargs_only, keyword_only, positivity, arithmetic):
        check_signature(fn, "f", ["answer", "topic"])
    cases = [
        (lambda prompts, texts: [], None, r"f: takes no 'completions' argument by name \(its signature: "
         r"<lambda>\(prompts, texts\)\); klrl calls fn\(prompts=\[\.\.\.\], completions=\[str, \.\.\.\]"),
        (lambda completions, /: [], None, r"f: takes no 'completions' argument by name"),
        (lambda prompts, /, completions: [], None, r"f: argument 'prompts' is positional-only"),
        (lambda *args: [], None, r"f: takes no 'completions' argument by name"),
        (lambda completions, answer: [], ["topic"], r"f: requires argument 'answer', which klrl does not "
         r"pass \(it passes prompts, completions, completion_ids and the prompt data's columns: topic\)"),
    ]  # fmt: skip
    for fn, columns, msg in cases:
        with pytest.raises(RewardLoadError, match=msg):
            check_signature(fn, "f", columns)
    check_signature(lambda completions, answer: [], "f")  # the columns unknown: only 'completions' checked
    with pytest.raises(RewardLoadError, match="requires argument 'answer'"):  # at construction, columns known
        make_host_reward([lambda completions, answer: []], None, tok, PROMPTS)


def test_load_reward_fn_checks_the_signature_and_survives_exits_at_import(tmp_path) -> None:
    (tmp_path / "r.py").write_text("def f(prompts, texts):\n    return texts\n")
    with pytest.raises(RewardLoadError, match=r"r.py:f: takes no 'completions' argument by name"):
        load_reward_fn(f"{tmp_path}/r.py:f")
    for body, did in [("import sys\nsys.exit(5)\n", r"it called sys.exit\(5\)"),
                      ("import sys\nsys.exit()\n", r"it called sys.exit\(\)"),
                      ("raise KeyboardInterrupt\n", "it raised KeyboardInterrupt")]:  # fmt: skip
        (tmp_path / "x.py").write_text(body)
        with pytest.raises(RewardLoadError, match=rf"x.py does not import \({did}\)$"):
            load_reward_fn(f"{tmp_path}/x.py:f")


def test_describe_says_what_the_code_did() -> None:
    from klrl.rewards.host import STRINGS_HINT, describe

    assert describe(SystemExit(5)) == "called sys.exit(5)"
    assert describe(SystemExit("bye")) == "called sys.exit('bye')"
    assert describe(KeyboardInterrupt()) == "raised KeyboardInterrupt"
    assert describe(ValueError("a\nb")) == "raised ValueError: a / b"
    completion = "text"
    for use in (lambda c: c[0]["content"], lambda c: c["content"], lambda c: c.get("content")):
        with pytest.raises((TypeError, AttributeError)) as e:
            use(completion)
        assert describe(e.value) == f"raised {type(e.value).__name__}: {e.value} ({STRINGS_HINT})"
    assert STRINGS_HINT not in describe(TypeError("unsupported operand"))


def _probe_fails(tok, fn, match, weights=None) -> None:
    rw = make_host_reward([fn] if callable(fn) else fn, weights, tok, PROMPTS, COLUMNS)
    with pytest.raises(RewardFunctionError, match=match) as e:
        rw.probe([0, 1], ["a good day", "17"])
    assert "\n" not in str(e.value)
    assert rw.n_errors == 0 and rw.errors == [] and rw.n_calls == 0  # nothing recorded: the run starts clean


def test_probe_calls_each_function_once_as_training_does(tok) -> None:
    seen = {}

    def record(prompts, completions, completion_ids, topic):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, topic=topic)
        return [1.0, None]

    make_host_reward(["positivity", record], None, tok, PROMPTS, COLUMNS).probe([2, 0], ["ok then", "fine"])
    assert seen == {
        "prompts": [PROMPTS[2], PROMPTS[0]],
        "completions": ["ok then", "fine"],
        "ids": [tok.encode("ok then"), tok.encode("fine")],
        "topic": ["maths", "maths"],
    }

    def exits(completions):
        raise SystemExit(3)

    def interrupts(completions):
        raise KeyboardInterrupt

    conversational = lambda completions: [c[0]["content"] for c in completions]  # noqa: E731
    _probe_fails(tok, exits, r"exits: called sys.exit\(3\) \(a call before compiling, on 2 prompt\(s\)")
    _probe_fails(tok, interrupts, r"interrupts: raised KeyboardInterrupt \(a call before compiling")
    _probe_fails(tok, conversational, r"raised TypeError: string indices must be integers.*not TRL "
                 r"conversational message lists \(.*\): use c, not c\[0\]\['content'\]\)")  # fmt: skip
    _probe_fails(tok, lambda completions: [1e39, 0.0], r"returned 1e\+39 for completion 0 \(prompt row 0\) "
                 r"\(inf in float32, whose largest value is 3.4e\+38\)")  # fmt: skip
    _probe_fails(tok, lambda completions: [1.0], r"returned 1 values for 2 completions")
    _probe_fails(tok, lambda completions: 1.0, r"returned a float, not a list of 2 values")
    big = lambda completions: [3e38, 0.0]  # noqa: E731  (finite in float32; twice it is not)
    _probe_fails(tok, [big, big], r"^reward functions: the weighted sum 1 \* 3e\+38 \(.*\) \+ 1 \* 3e\+38 "
                 r"\(.*\) = 6e\+38 for completion 0 is not finite in float32")  # fmt: skip


def test_float32_is_checked_during_training_too(tok, batch) -> None:
    resp, mask = batch
    huge = lambda completions: [1e39 if i == 2 else 1.0 for i in range(len(completions))]  # noqa: E731
    rw = make_host_reward([huge], None, tok, PROMPTS)
    scores, _, error = rw.score_numpy(IDX, resp, mask)
    assert error.tolist() == [0, 0, NOT_FINITE, 0, 0, 0, 0, 0] and np.isfinite(scores).all()
    with pytest.raises(
        RewardFunctionError, match=r"returned 1e\+39 for completion 2 \(prompt row 2\) \(inf in"
    ):
        rw.check(error)
    big = lambda completions: [3e38 if i == 5 else 1.0 for i in range(len(completions))]  # noqa: E731
    rw = make_host_reward([big, big], None, tok, PROMPTS)
    scores, _, error = rw.score_numpy(IDX, resp, mask)
    assert error.tolist() == [0, 0, 0, 0, 0, NOT_FINITE, 0, 0] and np.isfinite(scores).all()
    with pytest.raises(RewardFunctionError, match=r"= 6e\+38 for completion 5 is not finite in float32"):
        rw.check(error)


def test_exits_and_interrupts_in_the_callback_are_recorded(tok, batch) -> None:
    """Under jit the function runs on a callback thread: SystemExit and KeyboardInterrupt must not
    escape through XLA; they are the function's failure."""
    resp, mask = batch

    def exits(completions):
        raise SystemExit(7)

    def interrupts(completions):
        raise KeyboardInterrupt

    for fn, msg in [
        (exits, r"exits: called sys.exit\(7\)$"),
        (interrupts, "interrupts: raised KeyboardInterrupt$"),
    ]:
        rw = make_host_reward([fn], None, tok, PROMPTS)
        scores, error = jax.jit(rw)(IDX, resp, mask)
        assert (np.asarray(error) == RAISED).all()
        with pytest.raises(RewardFunctionError, match=msg):
            rw.check(error)


def test_a_real_ctrl_c_during_the_call_is_the_users(tok) -> None:
    """On the main thread: a SIGINT that arrives while the function runs is the user's Ctrl-C. With
    Python's default handler it stays a KeyboardInterrupt (passed on, not the function's failure);
    under the run's StopSignals it is a stop request (recorded there) and the call goes on."""
    import os
    import signal
    import time

    from klrl.loop.reliability import StopSignals

    def slow(completions):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here
        return [1.0] * len(completions)

    rw = make_host_reward([slow], None, tok, PROMPTS)
    # Python's default handler, installed here: a pytest started from a background shell (nohup, many
    # CI runners) inherits SIGINT ignored, and Python then leaves it ignored (issue 49)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rw.probe([0], ["x"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        with StopSignals(log=lambda s: None) as stop:
            rw.probe([0], ["x"])  # no failure: the call finished
            assert stop.name == "SIGINT"
    finally:
        signal.signal(signal.SIGINT, inherited)


# ---- conversational completions (TRL's rule) ----------------------------------------------------

CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


def test_conversation_prompts_get_trl_message_lists(tok, batch) -> None:
    """TRL's GRPOTrainer: where ``is_conversational(prompt)``, each completion is
    ``[{"role": "assistant", "content": text}]``; a string prompt's completion is its text. A pool
    mixing both gets each row's own form; ``text``/``messages`` force one form."""
    seen = {}

    def trl_style(prompts, completions, **kw):  # a TRL conversational reward, as TRL's docs write them
        seen["completions"] = completions
        return [float(len(c[0]["content"])) for c in completions]

    resp, mask = batch
    rw = make_host_reward([trl_style], None, tok, CHATS, COLUMNS)
    scores, error = jax.jit(rw)(jnp.asarray(IDX), jnp.asarray(resp), jnp.asarray(mask))
    assert not np.asarray(error).any()
    assert seen["completions"] == [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    np.testing.assert_array_equal(np.asarray(scores), [float(len(c)) for c in COMPLETIONS])
    mixed = [CHATS[0], PROMPTS[1], CHATS[2], PROMPTS[3]]
    record = lambda completions: seen.update(completions=completions) or [0.0] * len(completions)  # noqa: E731
    make_host_reward([record], None, tok, mixed).score_numpy(IDX[:4], resp[:4], mask[:4])
    assert seen["completions"] == [
        [{"role": "assistant", "content": COMPLETIONS[0]}], COMPLETIONS[1],
        [{"role": "assistant", "content": COMPLETIONS[2]}], COMPLETIONS[3],
    ]  # fmt: skip
    make_host_reward([record], None, tok, CHATS, completions="text").score_numpy(IDX[:2], resp[:2], mask[:2])
    assert seen["completions"] == COMPLETIONS[:2]
    make_host_reward([record], None, tok, PROMPTS, completions="messages").score_numpy(
        IDX[:1], resp[:1], mask[:1]
    )
    assert seen["completions"] == [[{"role": "assistant", "content": COMPLETIONS[0]}]]
    with pytest.raises(
        RewardLoadError, match=r"^reward completions 'chat': expected one of auto, text, messages$"
    ):
        make_host_reward([record], None, tok, PROMPTS, completions="chat")


def test_builtins_read_both_forms(tok, batch) -> None:
    """The built-in rewards score a conversation prompt's message lists as they score the text."""
    resp, mask = batch
    text = make_host_reward(["positivity", "arithmetic"], None, tok, PROMPTS, COLUMNS).score_numpy(
        IDX, resp, mask
    )
    chat = make_host_reward(["positivity", "arithmetic"], None, tok, CHATS, COLUMNS).score_numpy(
        IDX, resp, mask
    )
    np.testing.assert_array_equal(text[1], chat[1])
    np.testing.assert_array_equal(text[0], chat[0])


def test_a_string_reward_on_conversations_is_told_the_rule(tok) -> None:
    """A function written for strings, given TRL's lists (conversation prompts), fails on its probe
    call with the rule and the setting that gives strings."""
    lower = lambda completions: [float("good" in c.lower()) for c in completions]  # noqa: E731
    rw = make_host_reward([lower], None, tok, CHATS)
    with pytest.raises(RewardFunctionError, match=r"raised AttributeError: 'list' object has no attribute "
                       r"'lower' \(completions are TRL conversational message lists .* set "
                       r"reward.completions=text for plain strings\) \(a call before compiling"):  # fmt: skip
        rw.probe([0, 1], ["a good day", "17"])
    make_host_reward([lower], None, tok, CHATS, completions="text").probe([0, 1], ["a good day", "17"])

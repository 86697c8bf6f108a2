"""Prompt files -> left-padded token pools: formats, chat template, truncation, held-out split, errors.

References: token rows are built by hand here (the ChatML text written out literally, encoded by
the test tokenizer, left-padded with a Python loop), never by the module under test.
"""

from __future__ import annotations

import csv
import json
import re
import sys

import numpy as np
import pytest
from texttok import make_tokenizer

from klrl.config import ConfigError
from klrl.data.prompts import (
    FILES,
    DataConfig,
    PromptDataError,
    PromptTruncationWarning,
    build_pool,
    load_prompts,
    read_records,
    split_indices,
)

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
RECORDS = [
    {"prompt": "Write a short review of a quiet beach.", "answer": "1", "topic": "beach"},
    {"prompt": "What is 17 + 25?", "answer": "42", "topic": "maths"},
    {"prompt": "Describe a rainy afternoon in one sentence.", "answer": "3", "topic": "rain"},
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def chatml(user: str) -> str:
    return SYSTEM + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def left_pad(rows: list[list[int]], P: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = [], []
    for ids in rows:
        ids = ids[-P:]
        tokens.append([pad] * (P - len(ids)) + ids)
        mask.append([0.0] * (P - len(ids)) + [1.0] * len(ids))
    return np.array(tokens, np.int32), np.array(mask, np.float32)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"prompt_len": 0}, "data.prompt_len"),
        ({"truncate": "right"}, "data.truncate"),
        ({"eval_fraction": 1.0}, "data.eval_fraction"),
        ({"eval_fraction": 0.1, "eval_path": "x.jsonl"}, "data.eval_fraction"),
        ({"format": "xml"}, "data.format"),
        ({"path": ""}, "data.path"),
        ({"field": ""}, "data.field"),
        ({"limit": -1}, "data.limit"),
    ],
)
def test_config_errors_name_the_field(kw, field) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}:"):
        DataConfig(**kw)


# ---- pools --------------------------------------------------------------------------------------


def test_jsonl_with_chat_template_is_left_padded(tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    P = 64
    splits = load_prompts(DataConfig(path=path, prompt_len=P), tok)
    pool = splits.train
    assert splits.eval is None and len(pool) == 3
    want_t, want_m = left_pad([tok.encode(chatml(r["prompt"])) for r in RECORDS], P, tok.pad_id)
    assert pool.tokens.dtype == np.int32 and pool.mask.dtype == np.float32
    assert pool.tokens.shape == (3, P)
    np.testing.assert_array_equal(pool.tokens, want_t)
    np.testing.assert_array_equal(pool.mask, want_m)
    assert pool.texts == [chatml(r["prompt"]) for r in RECORDS]
    assert pool.prompts == [r["prompt"] for r in RECORDS]
    assert pool.columns == {"answer": ["1", "42", "3"], "topic": ["beach", "maths", "rain"]}
    assert pool.n_truncated == 0 and list(pool.rows) == [0, 1, 2]
    assert max(len(tok.encode(t)) for t in pool.texts) < P
    # every prompt ends at the last column: the response starts right after it
    assert (pool.mask[:, -1] == 1).all()


def test_without_chat_template_encodes_the_raw_text(tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    pool = load_prompts(DataConfig(path=path, prompt_len=16, chat_template=False), tok).train
    want_t, want_m = left_pad([tok.encode(r["prompt"]) for r in RECORDS], 16, tok.pad_id)
    np.testing.assert_array_equal(pool.tokens, want_t)
    np.testing.assert_array_equal(pool.mask, want_m)
    assert pool.texts == [r["prompt"] for r in RECORDS]


def _write_all_formats(tmp_path) -> dict[str, str]:
    out = {"jsonl": write_jsonl(tmp_path / "p.jsonl", RECORDS)}
    (tmp_path / "p.json").write_text(json.dumps(RECORDS))
    out["json"] = str(tmp_path / "p.json")
    with open(tmp_path / "p.csv", "w", newline="", encoding="utf-8-sig") as f:  # with a BOM, as Excel writes
        w = csv.DictWriter(f, fieldnames=["prompt", "answer", "topic"])
        w.writeheader()
        w.writerows(RECORDS)
    out["csv"] = str(tmp_path / "p.csv")
    (tmp_path / "p.txt").write_text("\n".join(r["prompt"] for r in RECORDS) + "\n\n")
    out["text"] = str(tmp_path / "p.txt")
    return out


def test_formats_give_the_same_pool(tok, tmp_path) -> None:
    paths = _write_all_formats(tmp_path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "p.parquet")
        paths["parquet"] = str(tmp_path / "p.parquet")
    except ImportError:
        pass
    want, _ = left_pad([tok.encode(chatml(r["prompt"])) for r in RECORDS], 64, tok.pad_id)
    for fmt, path in paths.items():
        pool = load_prompts(DataConfig(path=path, prompt_len=64), tok).train
        np.testing.assert_array_equal(pool.tokens, want, err_msg=fmt)
        assert pool.prompts == [r["prompt"] for r in RECORDS], fmt
        if fmt != "text":
            assert pool.columns["answer"] == ["1", "42", "3"], fmt
    assert {"jsonl", "json", "csv", "text"} <= set(paths)


def test_saved_datasets_directory(tok, tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    want, _ = left_pad([tok.encode(chatml(r["prompt"])) for r in RECORDS], 64, tok.pad_id)
    pool = load_prompts(DataConfig(path=str(tmp_path / "ds"), prompt_len=64), tok).train
    np.testing.assert_array_equal(pool.tokens, want)
    assert pool.columns["topic"] == ["beach", "maths", "rain"]
    test = load_prompts(DataConfig(path=str(tmp_path / "dd"), split="test", prompt_len=64), tok).train
    np.testing.assert_array_equal(test.tokens, want[1:2])
    with pytest.raises(PromptDataError, match="no split 'dev'"):
        load_prompts(DataConfig(path=str(tmp_path / "dd"), split="dev"), tok)
    (tmp_path / "not-a-dataset").mkdir()
    with pytest.raises(PromptDataError, match=r"not-a-dataset: not a saved datasets directory"):
        read_records(tmp_path / "not-a-dataset")


def test_messages_column(tok, tmp_path) -> None:
    recs = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]},
        {"messages": [{"role": "user", "content": "Name a fruit."}]},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", recs)
    pool = load_prompts(DataConfig(path=path, field="messages", prompt_len=80), tok).train
    texts = [
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
        chatml("Name a fruit."),
    ]
    assert pool.texts == texts
    want, _ = left_pad([tok.encode(t) for t in texts], 80, tok.pad_id)
    np.testing.assert_array_equal(pool.tokens, want)
    assert pool.prompts == [r["messages"] for r in recs]
    with pytest.raises(PromptDataError, match=r"m\.jsonl line 1: a conversation needs data.chat_template"):
        load_prompts(DataConfig(path=path, field="messages", chat_template=False), tok)


def test_left_truncation_is_counted(tok, tmp_path) -> None:
    long = "the cat sat on the mat and the dog sat on the log " * 3
    recs = [{"prompt": "hello"}, {"prompt": long}, {"prompt": long + "again"}]
    path = write_jsonl(tmp_path / "t.jsonl", recs)
    P = 12
    with pytest.warns(PromptTruncationWarning, match=r"2 of 3 prompts longer than data.prompt_len = 12"):
        pool = load_prompts(DataConfig(path=path, prompt_len=P, chat_template=False), tok).train
    full = [tok.encode(r["prompt"]) for r in recs]
    assert len(full[0]) < P < len(full[1])
    want_t, want_m = left_pad(full, P, tok.pad_id)  # keeps the last P tokens
    np.testing.assert_array_equal(pool.tokens, want_t)
    np.testing.assert_array_equal(pool.mask, want_m)
    assert pool.n_truncated == 2 and list(pool.truncated) == [False, True, True]
    with pytest.raises(
        PromptDataError, match=r"t\.jsonl line 2: prompt has \d+ tokens, more than data.prompt_len"
    ):
        load_prompts(DataConfig(path=path, prompt_len=P, chat_template=False, truncate="error"), tok)


def test_eval_fraction_is_a_deterministic_disjoint_split(tok, tmp_path) -> None:
    recs = [{"prompt": f"prompt number {i}", "k": i} for i in range(40)]
    path = write_jsonl(tmp_path / "e.jsonl", recs)
    cfg = DataConfig(path=path, prompt_len=16, chat_template=False, eval_fraction=0.25, seed=3)
    a, b = load_prompts(cfg, tok), load_prompts(cfg, tok)
    assert len(a.eval) == 10 and len(a.train) == 30
    tr, ev = a.train.columns["k"], a.eval.columns["k"]
    assert sorted(tr + ev) == list(range(40)) and not set(tr) & set(ev)
    assert tr == sorted(tr) and ev == sorted(ev)  # file order kept in both pools
    assert list(a.train.rows) == tr and list(a.eval.rows) == ev
    assert b.eval.columns["k"] == ev  # deterministic
    other = load_prompts(cfg.__class__(**{**cfg.__dict__, "seed": 4}), tok)
    assert other.eval.columns["k"] != ev
    for pool in (a.train, a.eval):
        want, _ = left_pad([tok.encode(f"prompt number {k}") for k in pool.columns["k"]], 16, tok.pad_id)
        np.testing.assert_array_equal(pool.tokens, want)
    assert split_indices(3, 0.01, 0)[1].size == 1  # at least one held out
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        split_indices(1, 0.5, 0)


def test_eval_path_and_limit(tok, tmp_path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", RECORDS)
    ev = write_jsonl(tmp_path / "eval.jsonl", RECORDS[:1])
    s = load_prompts(DataConfig(path=train, eval_path=ev, prompt_len=64, limit=2), tok)
    assert len(s.train) == 2 and len(s.eval) == 1
    np.testing.assert_array_equal(s.eval.tokens, s.train.tokens[:1])
    assert s.eval.source.endswith("eval.jsonl")


def test_take(tok, tmp_path) -> None:
    pool = load_prompts(DataConfig(path=write_jsonl(tmp_path / "p.jsonl", RECORDS), prompt_len=64), tok).train
    sub = pool.take(np.array([2, 0]))
    np.testing.assert_array_equal(sub.tokens, pool.tokens[[2, 0]])
    assert sub.prompts == [RECORDS[2]["prompt"], RECORDS[0]["prompt"]]
    assert sub.columns["topic"] == ["rain", "beach"] and list(sub.rows) == [2, 0]


# ---- errors: one line naming the file, row or column ---------------------------------------------


def test_file_errors(tok, tmp_path) -> None:
    with pytest.raises(PromptDataError, match=r"nope\.jsonl: prompt file not found"):
        read_records(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptDataError, match=r"empty\.jsonl: no prompts in the file"):
        read_records(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(PromptDataError, match=r"bad\.jsonl line 2: not valid JSON"):
        read_records(tmp_path / "bad.jsonl")
    (tmp_path / "p.xml").write_text("<a/>")
    with pytest.raises(PromptDataError, match=r"p\.xml: unknown prompt file type '\.xml'"):
        read_records(tmp_path / "p.xml")
    with pytest.raises(
        PromptDataError, match=r"klrl:nothing: no such shipped prompt file .*klrl:instructions"
    ):
        read_records("klrl:nothing")


def test_missing_column_names_file_and_column(tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", RECORDS)
    with pytest.raises(
        PromptDataError, match=r"c\.jsonl: no column 'question' \(line 1; columns: prompt, answer"
    ):
        load_prompts(DataConfig(path=path, field="question"), tok)
    bad = write_jsonl(tmp_path / "v.jsonl", [{"prompt": 3}])
    with pytest.raises(PromptDataError, match=r"v\.jsonl line 1: expected a string or a list of"):
        load_prompts(DataConfig(path=bad), tok)


def test_chat_template_problems(tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    failing = make_tokenizer("{{ raise_exception('no such thing') }}")  # undefined in this environment
    with pytest.raises(PromptDataError, match=r"p\.jsonl line 1: the chat template failed \(UndefinedError"):
        load_prompts(DataConfig(path=path), failing)
    broken = make_tokenizer("{% for m in messages %}")  # a syntax error
    with pytest.raises(
        PromptDataError, match=r"p\.jsonl line 1: the chat template failed \(TemplateSyntaxError"
    ):
        load_prompts(DataConfig(path=path), broken)
    none = make_tokenizer(None)
    with pytest.raises(
        PromptDataError, match=r"the tokenizer has no chat template; set data.chat_template false"
    ):
        load_prompts(DataConfig(path=path), none)
    assert len(load_prompts(DataConfig(path=path, chat_template=False), none).train) == 3


def test_parquet_without_pyarrow_is_one_clear_line(tok, tmp_path, monkeypatch) -> None:
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        PromptDataError, match=r"p\.parquet: reading Parquet needs pyarrow \(pip install pyarrow\)"
    ):
        read_records(tmp_path / "p.parquet")


def test_empty_prompt_is_an_error(tok, tmp_path) -> None:
    with pytest.raises(PromptDataError, match=r"row 1: the prompt encodes to no tokens"):
        build_pool([{"prompt": "a"}, {"prompt": ""}], tok, DataConfig(chat_template=False), source="mem")


# ---- shipped files ------------------------------------------------------------------------------


def test_shipped_instructions(tok) -> None:
    recs, _ = read_records("klrl:instructions")
    prompts = [r["prompt"] for r in recs]
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    assert all(3 <= len(p.split()) <= 20 for p in prompts)
    assert len({r["topic"] for r in recs}) >= 40
    pool = load_prompts(DataConfig(path="klrl:instructions", prompt_len=96, eval_fraction=0.1), tok)
    assert len(pool.train) + len(pool.eval) == len(prompts) and pool.train.n_truncated == 0


def test_shipped_arithmetic_answers_are_right() -> None:
    recs, _ = read_records(FILES / "arithmetic.jsonl")
    assert len(recs) >= 300
    ops = {"+": int.__add__, "plus": int.__add__, "-": int.__sub__, "minus": int.__sub__,
           "*": int.__mul__, "times": int.__mul__}  # fmt: skip
    for r in recs:
        m = re.search(r"(\d+) (\+|-|\*|plus|minus|times) (\d+)", r["prompt"])
        assert m, r
        assert ops[m.group(2)](int(m.group(1)), int(m.group(3))) == r["answer"], r

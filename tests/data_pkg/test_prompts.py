"""Prompt files -> left-padded token pools: formats, chat template, truncation, held-out split, errors.

References: token rows are built by hand here (the ChatML text written out literally, encoded by
the test tokenizer, left-padded with a Python loop), never by the module under test.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import warnings

import numpy as np
import pytest
from texttok import make_tokenizer

from klrl.config import ConfigError
from klrl.data.prompts import (
    FILES,
    DataConfig,
    PromptDataError,
    build_pool,
    chat_format,
    check_fields,
    check_unused,
    counts_line,
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
    with pytest.raises(
        PromptDataError, match=r"no column 'prompt' \(line 1; columns: messages\); set data.field messages$"
    ):
        load_prompts(DataConfig(path=path), tok)
    # TRL's conversational prompt-only rows: the conversation in the prompt column
    conv = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "Name a fruit."}]}])
    np.testing.assert_array_equal(
        load_prompts(DataConfig(path=conv, prompt_len=80), tok).train.tokens, want[1:]
    )


def test_left_truncation_without_template_is_counted_not_warned(tok, tmp_path) -> None:
    long = "the cat sat on the mat and the dog sat on the log " * 3
    recs = [{"prompt": "hello"}, {"prompt": long}, {"prompt": long + "again"}]
    path = write_jsonl(tmp_path / "t.jsonl", recs)
    P = 12
    cfg = DataConfig(path=path, prompt_len=P, chat_template=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = load_prompts(cfg, tok).train
    full = [tok.encode(r["prompt"]) for r in recs]
    assert len(full[0]) < P < len(full[1])
    want_t, want_m = left_pad(full, P, tok.pad_id)  # no template, no BOS: keeps the last P tokens
    np.testing.assert_array_equal(pool.tokens, want_t)
    np.testing.assert_array_equal(pool.mask, want_m)
    assert pool.n_truncated == 2 and list(pool.truncated) == [False, True, True]
    assert pool.n_templated == 0
    assert counts_line(pool, cfg) == (
        f"prompts {path}: 2 of 3 longer than data.prompt_len = 12 tokens were cut to it inside the user "
        "content (its first tokens dropped; the chat template kept)"
    )
    with pytest.raises(
        PromptDataError, match=r"t\.jsonl line 2: prompt has \d+ tokens, more than data.prompt_len"
    ):
        load_prompts(DataConfig(path=path, prompt_len=P, chat_template=False, truncate="error"), tok)


USER, END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
LONG = "the cat sat on the mat and the dog sat on the log " * 4 + "What is 17 + 25?"


def test_templated_prompts_are_wrapped_once(tok, tmp_path) -> None:
    """A prompt that is already ChatML text (as apply_chat_template writes it, with the default or its
    own system turn) is encoded as it is: the ids of one template application, one system turn."""
    own = "<|im_start|>system\nBe brief.<|im_end|>\n" + USER + "Say hi." + END
    recs = [{"prompt": chatml("What is 17 + 25?")}, {"prompt": own}, {"prompt": "What is 17 + 25?"}]
    cfg = DataConfig(path=write_jsonl(tmp_path / "t.jsonl", recs), prompt_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = load_prompts(cfg, tok).train
    once = tok.encode(chatml("What is 17 + 25?"))
    want, _ = left_pad([once, tok.encode(own), once], 64, tok.pad_id)
    np.testing.assert_array_equal(pool.tokens, want)
    for row, m in zip(pool.tokens, pool.mask, strict=True):
        text = tok.decode([int(i) for i, k in zip(row, m, strict=True) if k], skip_special_tokens=False)
        assert text.count("<|im_start|>system") == 1 and text.count("<|im_start|>user") == 1
    assert list(pool.templated) == [True, True, False] and pool.n_templated == 2 and pool.n_truncated == 0
    assert pool.texts[:2] == [chatml("What is 17 + 25?"), own]
    assert counts_line(pool, cfg) == (
        f"prompts {cfg.path}: 2 of 3 already carry the chat template (not wrapped again)"
    )
    # with the template off they are counted the same (and encoded as they are)
    off = load_prompts(DataConfig(path=cfg.path, prompt_len=64, chat_template=False), tok).train
    np.testing.assert_array_equal(off.tokens[:2], want[:2])
    assert list(off.templated) == [True, True, False]


def _cut_by_hand(tok, before: str, content: str, after: str, P: int) -> list[int]:
    """The reference: the template's text before and after the user content encoded alone, the
    content's own tokens with its first ones dropped so that the row has exactly P tokens."""
    head, tail = tok.encode(before), tok.encode(after)
    return head + tok.encode(content)[-(P - len(head) - len(tail)) :] + tail


def test_long_prompts_are_cut_inside_the_user_content(tok, tmp_path) -> None:
    """A plain string, a conversation and an already-templated string longer than P keep the system
    turn, the user header and the generation prompt; their rows are exactly P tokens; no warning."""
    P = 48
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]
    recs = [{"prompt": LONG}, {"prompt": conv}, {"prompt": chatml(LONG)}, {"prompt": "What is 17 + 25?"}]
    cfg = DataConfig(path=write_jsonl(tmp_path / "l.jsonl", recs), prompt_len=P)
    assert len(tok.encode(chatml(LONG))) > P
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = load_prompts(cfg, tok).train
    want, mask = left_pad(
        [
            _cut_by_hand(tok, SYSTEM + USER, LONG, END, P),
            _cut_by_hand(tok, "<|im_start|>system\nBe brief.<|im_end|>\n" + USER, LONG, END, P),
            _cut_by_hand(tok, SYSTEM + USER, LONG, END, P),
            tok.encode(chatml("What is 17 + 25?")),
        ],
        P,
        tok.pad_id,
    )
    np.testing.assert_array_equal(pool.tokens, want)
    assert (pool.mask[:3].sum(axis=1) == P).all()
    for row in pool.tokens[:3]:
        text = tok.decode([int(i) for i in row], skip_special_tokens=False)
        assert text.startswith(("<|im_start|>system\n",)) and USER in text and text.endswith(END)
        assert text.endswith("17 + 25?" + END)  # the end of the request survives
    assert list(pool.truncated) == [True, True, True, False] and list(pool.templated) == [
        False,
        False,
        True,
        False,
    ]
    assert pool.texts[0] == chatml(LONG)  # the text before the cut


def test_conversation_cuts_the_earliest_user_message_first(tok) -> None:
    first = "the cat sat on the mat " * 3
    conv = [{"role": "user", "content": first}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "What is 17 + 25?"}]  # fmt: skip
    before = SYSTEM + USER
    middle = "<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n" + USER
    full = (
        tok.encode(before)
        + tok.encode(first)
        + tok.encode(middle)
        + tok.encode("What is 17 + 25?")
        + tok.encode(END)
    )
    for drop in (2, len(tok.encode(first)) + 1):  # part of the first message; all of it and one more token
        P = len(full) - drop
        pool = build_pool([{"prompt": conv}], tok, DataConfig(prompt_len=P), source="mem")
        firsts, seconds = tok.encode(first), tok.encode("What is 17 + 25?")
        k1 = max(0, len(firsts) - drop)
        k2 = len(seconds) - max(0, drop - len(firsts))
        want = (
            tok.encode(before)
            + firsts[len(firsts) - k1 :]
            + tok.encode(middle)
            + seconds[len(seconds) - k2 :]
        )
        want += tok.encode(END)
        assert [int(i) for i in pool.tokens[0]] == want and pool.n_truncated == 1


def test_template_alone_over_the_budget_is_one_line_naming_prompt_len(tok, tmp_path) -> None:
    fixed = len(tok.encode(SYSTEM + USER)) + len(tok.encode(END))
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": LONG}])
    with pytest.raises(PromptDataError) as e:
        load_prompts(DataConfig(path=path, prompt_len=fixed), tok)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path} line 1: the chat template around the user message")
    assert f"takes {fixed} tokens" in msg and f"data.prompt_len = {fixed}" in msg
    # one more token: the user content keeps its last token
    pool = load_prompts(DataConfig(path=path, prompt_len=fixed + 1), tok).train
    assert [int(i) for i in pool.tokens[0]] == _cut_by_hand(tok, SYSTEM + USER, LONG, END, fixed + 1)


def test_templated_prompt_without_user_turn_over_the_budget_is_an_error(tok) -> None:
    text = "<|im_start|>system\n" + LONG + "<|im_end|>\n"
    with pytest.raises(PromptDataError, match=r"mem row 0: prompt has \d+ tokens, more than data.prompt_len "
                       r"= 20, and its user message cannot be found"):  # fmt: skip
        build_pool([{"prompt": text}], tok, DataConfig(prompt_len=20), source="mem")


def test_chat_format_reads_the_markers_and_user_header(tok) -> None:
    fmt = chat_format(tok)
    assert fmt.markers == ("<|im_start|>", "<|im_end|>") and fmt.user_header == "<|im_start|>user\n"
    assert chat_format(make_tokenizer(None)) is None
    # Llama-3-shaped (a header of two markers, <|start_header_id|>user<|end_header_id|>, spelled with the
    # test vocabulary's special tokens; the content is trimmed): the header reaches back to the marker
    # before the role name, and a templated prompt is cut between it and the next marker
    shaped = make_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n"
        "{{ m['content'] | trim }}<|endoftext|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
    )
    fmt = chat_format(shaped)
    assert fmt.markers == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert fmt.user_header == "<|im_start|>user<|im_end|>\n\n"
    head, tail = "<|im_start|>user<|im_end|>\n\n", "<|endoftext|><|im_start|>assistant<|im_end|>\n\n"
    P = 20
    for value in (f"  {LONG} ", head + LONG + tail):  # rendered (trimmed) and already templated
        pool = build_pool([{"prompt": value}], shaped, DataConfig(prompt_len=P), source="mem")
        assert [int(i) for i in pool.tokens[0]] == _cut_by_hand(shaped, head, LONG, tail, P)


# ---- data fields set without effect --------------------------------------------------------------


def test_split_on_a_file_is_an_error_naming_data_split(tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    want = (
        r"^data.split: 'nosuch' is read only from a saved datasets.DatasetDict directory; .*p\.jsonl is a "
        r"\.jsonl file, which has no splits$"
    )
    with pytest.raises(ConfigError, match=want):
        load_prompts(DataConfig(path=path, split="nosuch"), tok)
    (tmp_path / "single").mkdir()  # a saved single Dataset has no dataset_dict.json
    with pytest.raises(ConfigError, match=r"^data.split: .*single is a saved single dataset"):
        check_fields(DataConfig(path=str(tmp_path / "single"), split="test"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    check_fields(DataConfig(path=str(tmp_path / "dd"), split="test"))  # a DatasetDict reads it
    check_fields(DataConfig(path=path, split="train"))  # the default


def test_seed_and_eval_every_without_heldout_prompts_are_errors(tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    with pytest.raises(
        ConfigError, match=r"^data.seed: 3 seeds only the held-out split of data.eval_fraction"
    ):
        load_prompts(DataConfig(path=path, seed=3), tok)
    with pytest.raises(ConfigError, match=r"^data.eval_every: 5, but there are no held-out prompts"):
        load_prompts(DataConfig(path=path, eval_every=5), tok)
    check_fields(DataConfig(path=path, eval_every=0))  # off: consistent
    check_fields(DataConfig(path=path, eval_every=5, eval_path=path))
    check_fields(DataConfig(path=path, seed=3, eval_fraction=0.5, eval_every=5))


def test_data_fields_on_a_task_that_generates_its_prompts() -> None:
    check_unused(DataConfig(), "testbed")
    want = r"^data.path: the testbed task generates its prompts; data.\* applies to --task.name text$"
    with pytest.raises(ConfigError, match=want):
        check_unused(DataConfig(path="p.jsonl"), "testbed")
    want = r"^data.split, data.prompt_len: the peer task generates its prompts \(its prompt length is task"
    with pytest.raises(ConfigError, match=want):
        check_unused(DataConfig(split="x", prompt_len=8), "peer")


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
    for dev in ("/dev/zero", "/dev/urandom"):  # an endless device was read until MemoryError
        with pytest.raises(PromptDataError, match=f"{dev}: not a regular file"):
            read_records(dev, format="text")
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

"""klrl.rewards.pairs: reading and checking TRL-style preference files, the token layout of a pair, the
held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from klrl.models.pretrained import from_pretrained
from klrl.rewards.pairs import PairsError, encode_pairs, gold_pairs, read_pairs, split

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"


@pytest.fixture(scope="module")
def tok():
    return from_pretrained(GGUF)[2]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_jsonl_and_parquet_alike(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"prompt": "p1", "chosen": "good", "rejected": "bad"}, {"chosen": "c", "rejected": "r"}]
    got = read_pairs(_jsonl(tmp_path / "x.jsonl", rows))
    assert got == rows
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet")
    assert read_pairs(tmp_path / "x.parquet") == [{**rows[0]}, {"prompt": None, **rows[1]}]


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("none.jsonl", None, ["not found"]),
        ("empty.jsonl", "", ["no pairs"]),
        ("x.csv", "chosen,rejected\na,b\n", [".csv", ".jsonl or .parquet"]),
        ("bad.jsonl", "{not json\n", ["line 1", "not valid JSON"]),
        ("nocol.jsonl", '{"prompt": "p", "chosen": "a", "reject": "b"}\n', ["line 1", "'rejected'"]),
        ("num.jsonl", '{"chosen": "a", "rejected": 3}\n', ["line 1", "rejected", "got int"]),
        ("blank.jsonl", '{"chosen": "  ", "rejected": "b"}\n', ["line 1", "chosen", "empty"]),
        ("msgs.jsonl", '{"chosen": [{"role": "assistant"}], "rejected": "b"}\n', ["chosen", "role, content"]),
        ("mixed.jsonl", '{"chosen": [{"role": "assistant", "content": "x"}], "rejected": "b"}\n', ["both"]),
        ("prompt.jsonl", '{"prompt": 7, "chosen": "a", "rejected": "b"}\n', ["prompt", "got int"]),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, name, content, words):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PairsError) as e:
        read_pairs(path)
    msg = str(e.value)
    assert "\n" not in msg and name in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_text_pair_layout(tok):
    """prompt ids, then response ids, then the end token; right-padded; the mask covers exactly them."""
    rows = [{"prompt": "ab", "chosen": "cd", "rejected": "efg"}]
    p = encode_pairs(rows, tok, 12)
    end = tok.stop_ids[0]
    want_c = tok.encode("ab", add_special_tokens=True) + tok.encode("cd") + [end]
    want_r = tok.encode("ab", add_special_tokens=True) + tok.encode("efg") + [end]
    assert p.chosen[0, : len(want_c)].tolist() == want_c and p.chosen_mask[0].sum() == len(want_c)
    assert p.rejected[0, : len(want_r)].tolist() == want_r and p.rejected_mask[0].sum() == len(want_r)
    assert (p.chosen[0, len(want_c) :] == tok.pad_id).all() and p.truncated == 0
    assert p.chosen.dtype == np.int32 and p.chosen_mask.dtype == np.float32


def test_conversations_use_the_chat_template(tok):
    """TRL's conversational format: the prompt messages rendered with the template (generation prompt),
    the last response message's content as the response; the implicit-prompt layout gives the same."""
    user = [{"role": "user", "content": "hi"}]
    explicit = {"prompt": user, "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": "no"}]}  # fmt: skip
    implicit = {"chosen": [*user, {"role": "assistant", "content": "yes"}],
                "rejected": [*user, {"role": "assistant", "content": "no"}]}  # fmt: skip
    a, b = encode_pairs([explicit], tok, 40), encode_pairs([implicit], tok, 40)
    head = tok.encode(tok.apply_chat_template(user, add_generation_prompt=True))
    want = head + tok.encode("yes") + [tok.stop_ids[0]]
    assert a.chosen[0, : len(want)].tolist() == want and a.chosen_mask[0].sum() == len(want)
    np.testing.assert_array_equal(a.chosen, b.chosen)
    np.testing.assert_array_equal(a.rejected_mask, b.rejected_mask)
    # a string prompt with chat_template=True is wrapped as one user message
    c = encode_pairs([{"prompt": "hi", "chosen": "yes", "rejected": "no"}], tok, 40, chat_template=True)
    np.testing.assert_array_equal(c.chosen, a.chosen)


def test_long_pairs_lose_the_prompt_start_then_the_response_end(tok):
    rows = [{"prompt": "abcdefgh", "chosen": "xy", "rejected": "z" * 30}]
    p = encode_pairs(rows, tok, 8)
    full = tok.encode("abcdefgh", add_special_tokens=True) + tok.encode("xy") + [tok.stop_ids[0]]
    assert p.chosen[0].tolist() == full[-8:] and p.chosen_mask[0].sum() == 8
    assert p.rejected[0].tolist() == tok.encode("z" * 30)[:8]
    assert p.truncated == 1


def test_split_is_seeded_disjoint_and_never_empty():
    tr, ev = split(40, 0.25, 3)
    assert len(ev) == 10 and len(tr) == 30 and not set(tr) & set(ev)
    np.testing.assert_array_equal(split(40, 0.25, 3)[1], ev)
    assert not np.array_equal(split(40, 0.25, 4)[1], ev)
    assert len(split(3, 0.01, 0)[1]) == 1 and len(split(3, 0.99, 0)[0]) == 1
    with pytest.raises(PairsError, match="1 pair"):
        split(1, 0.5, 0)


def test_pairs_are_within_prompt_in_the_golds_order_and_flip_at_the_noise_rate():
    rows = [{"prompt_idx": i // 4, "gold": float(i % 4), "completion": f"r{i}"} for i in range(400)]
    prompts = [f"p{i}" for i in range(100)]
    clean = gold_pairs(rows, prompts, 500, 0.0, 0)
    assert len(clean) == 500 and len({(p["chosen"], p["rejected"]) for p in clean}) == 500
    for p in clean:
        c, r = int(p["chosen"][1:]), int(p["rejected"][1:])
        assert c // 4 == r // 4 and p["prompt"] == prompts[c // 4] and c % 4 > r % 4
    noisy = gold_pairs(rows, prompts, 600, 0.3, 1)  # all 6 pairs of each of the 100 prompts
    rate = np.mean([not p["gold_chosen"] for p in noisy])
    assert len(noisy) == 600 and abs(rate - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 600)

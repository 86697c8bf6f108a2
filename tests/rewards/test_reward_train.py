"""klrl.rewards.train and ``klrl reward-model``: the Bradley-Terry loss and accuracy against NumPy, a
reward model trained on the tiny GGUF that separates a marker word on held-out pairs, its directory read
back by klrl's ``--model.reward_path`` (a rollout's reward) and by transformers (same scores), LoRA
adapters merged exactly, and bad input as one line with exit status 2."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_import, one_line_error

from klrl.cli import main as klrl_main
from klrl.config import ModelConfig, RunConfig
from klrl.data.hf_tokenizer import load_tokenizer_dir
from klrl.models import lora as lora_lib
from klrl.models.base import forward
from klrl.models.hf import load_hf, load_score_head
from klrl.models.pretrained import from_pretrained
from klrl.models.rollout import Rollout
from klrl.rewards.pairs import encode_pairs, split
from klrl.rewards.train import (
    Trainable,
    TrainSettings,
    accuracy,
    bt_loss,
    make_evaluate,
    save_reward_model,
    scores,
    seq_cls_architecture,
    train,
)
from klrl.tasks.text import model_reward, reward_model

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"
WORDS = "ab cd ef gh ij kl mn op".split()
jit_scores = jax.jit(scores, static_argnums=0)  # (model, trunk, score, tokens, mask) -> [B]


def marker_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` pairs whose chosen response holds the word ``yes`` and whose rejected one does not."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        filler = [rng.choice(WORDS) for _ in range(2)]
        chosen = list(filler)
        chosen.insert(rng.randrange(3), "yes")
        rows.append({"prompt": rng.choice(WORDS), "chosen": " ".join(chosen),
                     "rejected": " ".join([*filler, rng.choice(WORDS)])})  # fmt: skip
    return rows


# ---- the maths against NumPy ------------------------------------------------------------------------
def test_bt_loss_and_accuracy_match_numpy_on_hand_values():
    rc = np.array([1.0, -0.5, 2.0, 0.3], np.float32)
    rr = np.array([0.0, 0.5, 2.0, -1.7], np.float32)
    d = rc - rr  # 1, -1, 0, 2
    want = np.mean(np.log1p(np.exp(-d)))  # -log sigmoid(d) = log(1 + e^-d)
    assert abs(want - (np.log1p(np.e**-1) + np.log1p(np.e) + np.log(2) + np.log1p(np.e**-2)) / 4) < 1e-7
    np.testing.assert_allclose(float(bt_loss(rc, rr)), want, rtol=1e-6)
    center = 0.01 * np.mean((rc + rr) ** 2)  # (1, 0, 4, -1.4)^2 = 1, 0, 16, 1.96 -> mean 4.74
    np.testing.assert_allclose(float(bt_loss(rc, rr, 0.01)), want + center, rtol=1e-6)
    assert abs(center - 0.0474) < 1e-6
    assert float(accuracy(rc, rr)) == 0.5  # 1 > 0 and 0.3 > -1.7; a tie (2 = 2) is wrong


def test_bt_loss_gradient_is_sigmoid_of_minus_margin():
    rc, rr = jnp.array([0.2, -1.0]), jnp.array([0.0, 1.0])
    g = jax.grad(lambda a: bt_loss(a, rr))(rc)
    np.testing.assert_allclose(np.asarray(g), -1 / (1 + np.exp(np.array([0.2, -2.0]))) / 2, rtol=1e-6)


def test_architecture_names():
    assert seq_cls_architecture("LlamaForCausalLM") == "LlamaForSequenceClassification"
    assert seq_cls_architecture("GPT2LMHeadModel") == "GPT2ForSequenceClassification"
    with pytest.raises(ValueError):
        seq_cls_architecture("BertModel")


# ---- one trained model, shared ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model, base, tok = from_pretrained(GGUF)
    rows = marker_pairs(40)
    pairs = encode_pairs(rows, tok, 16)
    tr, ev = split(len(rows), 0.25, 0)
    s = TrainSettings(epochs=3, lr=3e-3, batch_size=10, seed=0)
    lines: list[str] = []
    trunk, score, history = train(model, base, pairs.take(tr), pairs.take(ev), s, log=lines.append)
    out = save_reward_model(model, trunk, score, tok, tmp_path_factory.mktemp("rm") / "rm")
    fresh = Trainable(model, base).init(jax.random.split(jax.random.key(0))[0])  # train's initial params
    before = make_evaluate(Trainable(model, base))(
        fresh, None, tuple(jnp.asarray(x) for x in pairs.take(ev)[:4])
    )
    return dict(model=model, tok=tok, before=before, trunk=trunk, score=score, history=history, lines=lines,
                out=out, eval=pairs.take(ev), rows=[rows[i] for i in ev])  # fmt: skip


def test_training_separates_the_marker_on_held_out_pairs(trained):
    """Held-out accuracy 0.4 before training (the fresh head; loss 0.84), 1.0 after 3 epochs (loss 7e-4)."""
    h = trained["history"]
    assert len(h) == 3 and len(trained["lines"]) == 3 and "held-out" in trained["lines"][0]
    assert h[-1]["loss"] < h[0]["loss"] and h[-1]["loss"] < np.log(2)
    assert trained["before"]["accuracy"] <= 0.6 and trained["before"]["loss"] > np.log(2)
    assert h[-1]["eval_accuracy"] >= 0.8, h  # 10 held-out pairs; chance is 0.5
    assert h[-1]["eval_loss"] < 0.1 * trained["before"]["loss"]


def test_directory_is_read_by_klrl_reward_path(trained):
    """``--model.reward_path DIR``: a rollout's reward (left-padded prompt, right-padded response) equals
    the training-time score of the same tokens, and a chosen response scores above its rejected one."""
    out, tok = trained["out"], trained["tok"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    np.testing.assert_array_equal(load_score_head(out)[0], trained["score"])
    model, params = reward_model(RunConfig(model=ModelConfig(reward_path=str(out))))
    r = model_reward(model, params)
    row = trained["rows"][0]
    p_ids = tok.encode(row["prompt"], add_special_tokens=True)
    P, R = 6, 12
    got = []
    for side in ("chosen", "rejected"):
        resp = tok.encode(row[side]) + [tok.stop_ids[0]]
        prompt = np.full((1, P), tok.pad_id, np.int32)
        prompt[0, P - len(p_ids) :] = p_ids
        response = np.full((1, R), tok.pad_id, np.int32)
        response[0, : len(resp)] = resp
        ro = Rollout(prompt, (prompt != tok.pad_id).astype(np.float32), response,
                     (np.arange(R) < len(resp))[None].astype(np.float32), None, None, None)  # fmt: skip
        got.append(float(jax.jit(r.fn)(r.params, ro)[0]))
    ev = trained["eval"]
    head = jnp.asarray(trained["score"])
    want = [jit_scores(trained["model"], trained["trunk"], head, ev[k][:1], ev[k + 1][:1]) for k in (0, 2)]
    np.testing.assert_allclose(got, [float(w[0]) for w in want], atol=1e-4)
    assert got[0] > got[1]


def test_transformers_loads_the_directory_and_scores_alike(trained):
    torch = hf_import("torch")
    transformers = hf_import("transformers")
    out, ev = trained["out"], trained["eval"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.pad_token_id == trained["tok"].pad_id == hf.config.pad_token_id
    # right-padded with the pad id, as transformers pads
    ids = np.concatenate([ev.chosen[:4], ev.rejected[:4]])
    mask = np.concatenate([ev.chosen_mask[:4], ev.rejected_mask[:4]])
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    want = jit_scores(trained["model"], trained["trunk"], jnp.asarray(trained["score"]), ids, mask)
    np.testing.assert_allclose(got.numpy()[:, 0], np.asarray(want), atol=1e-4)


def test_held_out_numbers_in_chunks_equal_the_whole_batch(trained):
    """make_evaluate scores 3 pairs at a time (the 10 held-out pairs: 4 chunks, the last one filled up):
    the loss and accuracy of all 10 at once, in NumPy."""
    ev, head = trained["eval"], jnp.asarray(trained["score"])
    rc = np.asarray(jit_scores(trained["model"], trained["trunk"], head, ev.chosen, ev.chosen_mask))
    rr = np.asarray(jit_scores(trained["model"], trained["trunk"], head, ev.rejected, ev.rejected_mask))
    evaluate = make_evaluate(Trainable(trained["model"], None), center_coef=0.1, chunk=3)
    got = evaluate({"trunk": trained["trunk"], "score": head}, None, tuple(jnp.asarray(x) for x in ev[:4]))
    want = np.mean(np.logaddexp(0, -(rc - rr))) + 0.1 * np.mean((rc + rr) ** 2)
    np.testing.assert_allclose(got["loss"], want, rtol=1e-5)
    assert got["accuracy"] == np.mean(rc > rr) == trained["history"][-1]["eval_accuracy"]


def test_a_pad_that_is_the_end_token_is_replaced_for_transformers(trained, tmp_path):
    """A tokenizer that pads with its end token (SmolLM2): transformers' classifier would read the token
    before it; the directory names another pad (BOS here) in config.json and tokenizer_config.json, so
    transformers' scores of a right-padded batch are klrl's again."""
    torch = hf_import("torch")
    transformers = hf_import("transformers")
    tok = trained["tok"]
    end = tok.stop_ids[0]
    special = {**tok.special, "pad_token": tok.decode([end], skip_special_tokens=False)}
    eos_pad = dataclasses.replace(tok, pad_id=end, special=special)
    out = save_reward_model(trained["model"], trained["trunk"], trained["score"], eos_pad, tmp_path / "rm")
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == tok.bos_id != end
    assert load_tokenizer_dir(out).pad_id == tok.bos_id
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert transformers.AutoTokenizer.from_pretrained(str(out)).pad_token_id == tok.bos_id
    ev = trained["eval"]
    ids = np.where(ev.chosen_mask[:4] > 0, ev.chosen[:4], tok.bos_id)
    assert (ids[np.arange(4), ev.chosen_mask[:4].sum(1).astype(int) - 1] == end).all()  # each ends on it
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()[:, 0]
    want = jit_scores(
        trained["model"], trained["trunk"], jnp.asarray(trained["score"]), ids, ev.chosen_mask[:4]
    )
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-4)


# ---- LoRA ---------------------------------------------------------------------------------------------
def test_lora_merged_trunk_scores_as_the_adapted_model():
    """With nonzero adapters, the merged trunk (what the directory holds) gives the adapted model's
    scores (which differ from the base's)."""
    model, base, tok = from_pretrained(GGUF)
    lm = lora_lib.LoRA(model, 2, 4.0)
    t = Trainable(model, base, lm)
    params = t.init(jax.random.key(1))
    noise = lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape)
    params["trunk"] = jax.tree.map(noise, params["trunk"])
    pairs = encode_pairs(marker_pairs(6), tok, 16)
    args = (params["score"], pairs.chosen, pairs.chosen_mask)
    adapted = jit_scores(lm, t.trunk(params, base), *args)
    merged = jit_scores(model, t.merged(params), *args)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), atol=1e-4)
    assert float(jnp.max(jnp.abs(adapted - jit_scores(model, base, *args)))) > 1e-3


# ---- the command --------------------------------------------------------------------------------------
def _pairs_file(tmp_path: Path, rows: list) -> Path:
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_command_writes_the_directory_and_its_numbers(tmp_path, capsys):
    f = _pairs_file(tmp_path, marker_pairs(12))
    out = tmp_path / "rm"
    flags = "--rm.epochs 2 --rm.batch_size 4 --data.prompt_len 32 --sampling.response_len 12".split()
    flags += "--eval-fraction 0.25 --lora.rank 2".split()  # an old spelling: still works, one warning line
    argv = ["reward-model", "--model.path", str(GGUF), "--pairs", str(f), "--out", str(out), *flags]
    assert klrl_main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    err = captured.err.strip().splitlines()
    assert err[0] == "warning: --eval-fraction is deprecated; use --rm.eval_fraction"
    assert (
        len(err) == 2
        and err[1].startswith("warning: the held-out accuracy ")
        and "rests on 3 pairs" in err[1]
    )
    assert lines[0].startswith("text format") and "chat template on" in lines[0], lines[0]
    assert "data.prompt_len 32" in lines[0] and "sampling.response_len 12" in lines[0]
    assert sum(line.startswith("epoch ") for line in lines) == 2 and "LoRA rank 2" in lines[1]
    assert "klrl.load_reward_model(" in lines[-1]
    doc = json.loads((out / "reward_model.json").read_text())
    assert doc["pairs"] == {"total": 12, "train": 9, "heldout": 3, "truncated": 0}
    assert doc["text_format"] == {"chat_template": True, "prompt_len": 32, "truncate": "left",
                                  "response_len": 12, "use_eos": True, "end_token": "<|im_end|>"}  # fmt: skip
    assert 0 <= doc["heldout_accuracy"] <= 1 and len(doc["history"]) == 2
    assert doc["settings"]["lora_rank"] == 2
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert load_score_head(out).shape == (1, 32)
    # LoRA trains the adapters (merged into the attention/MLP kernels) and the head; the rest is the base's
    _, trained, _ = load_hf(out, score=True)
    _, base, _ = from_pretrained(GGUF)
    emb = lambda p: np.asarray(p["params"]["embed_tokens"]["embedding"])
    np.testing.assert_array_equal(emb(trained), emb(base))
    layers = [jax.tree.leaves(p["params"]["layers"]) for p in (trained, base)]
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(*layers, strict=True)]
    assert max(moved) > 0


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", ["--pairs", "not found"]),
        ("empty", ["no pairs"]),
        ("csv", [".csv"]),
        ("column", ["'rejected'"]),
        ("nontext", ["got dict"]),
        ("blank", ["chosen", "empty"]),
        ("model", ["--model.path", "nope"]),
        ("badmodel", ["--model.path"]),
        ("out", ["--out", "not an empty directory"]),
        ("lr", ["--rm.lr", "> 0"]),
        ("targets", ["--lora.targets", "zzz"]),
        ("maxlen", ["--max-len", "--data.prompt_len", "--sampling.response_len"]),
        ("typo", ["--rm.epoch", "did you mean --rm.epochs?"]),
        ("len", ["data.prompt_len", ">= 1"]),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case, words):
    good = _pairs_file(tmp_path, marker_pairs(4))
    args = {"--model.path": str(GGUF), "--pairs": str(good), "--out": str(tmp_path / "rm")}
    extra: list[str] = []
    if case == "missing":
        args["--pairs"] = str(tmp_path / "none.jsonl")
    elif case == "empty":
        (tmp_path / "e.jsonl").write_text("\n")
        args["--pairs"] = str(tmp_path / "e.jsonl")
    elif case == "csv":
        (tmp_path / "p.csv").write_text("chosen,rejected\na,b\n")
        args["--pairs"] = str(tmp_path / "p.csv")
    elif case in ("column", "nontext", "blank"):
        row = {"column": {"chosen": "a", "reject": "b"}, "nontext": {"chosen": "a", "rejected": {"x": 1}},
               "blank": {"chosen": "", "rejected": "b"}}[case]  # fmt: skip
        args["--pairs"] = str(_pairs_file(tmp_path, [row]))
    elif case == "model":
        args["--model.path"] = str(tmp_path / "nope")
    elif case == "badmodel":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text('{"model_type": "nonesuch"}')
        args["--model.path"] = str(tmp_path / "m")
    elif case == "out":
        (tmp_path / "rm").mkdir()
        (tmp_path / "rm" / "x").write_text("keep")
    elif case == "lr":
        extra = ["--lr", "0"]  # the old spelling: the error names the new one
    elif case == "maxlen":
        extra = ["--max-len", "16"]
    elif case == "typo":
        extra = ["--rm.epoch", "3"]
    elif case == "len":
        extra = ["--data.prompt_len", "0"]
    elif case == "targets":
        extra = ["--lora.rank", "2", "--lora.targets", "zzz"]
    argv = ["reward-model", *[x for kv in args.items() for x in kv], *extra]
    line = one_line_error(capsys, klrl_main, argv)
    for w in words:
        assert w in line, (w, line)
    if case != "out":
        assert not (tmp_path / "rm").exists()


def test_head_only_trains_a_linear_probe_of_the_frozen_trunk(tmp_path, capsys):
    """``head_only``: the trunk returned is the base's very arrays, only the head moved, and a linear probe
    of the last hidden state separates the marker; the command refuses it together with adapters."""
    model, base, tok = from_pretrained(GGUF)
    rows = marker_pairs(40)
    pairs = encode_pairs(rows, tok, 16)
    tr, ev = split(len(rows), 0.25, 0)
    s = TrainSettings(epochs=8, lr=3e-2, batch_size=10, seed=0)
    trunk, score, history = train(model, base, pairs.take(tr), pairs.take(ev), s, head_only=True)
    assert all(a is b for a, b in zip(jax.tree.leaves(trunk), jax.tree.leaves(base), strict=True))
    assert Trainable(model, base, head_only=True).init(jax.random.key(0))["trunk"] == {}
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["eval_accuracy"] >= 0.8, history
    # the head alone scores as score . h_last of the base (NumPy dot of the base's hidden states)
    h = np.asarray(jax.jit(lambda t, m: forward(model, base, t, m, logits=False).hidden)(
        jnp.asarray(pairs.chosen), jnp.asarray(pairs.chosen_mask) > 0))  # fmt: skip
    last = h[np.arange(len(h)), pairs.chosen_mask.sum(1).astype(int) - 1]
    got = jit_scores(
        model, trunk, jnp.asarray(score), jnp.asarray(pairs.chosen), jnp.asarray(pairs.chosen_mask)
    )
    np.testing.assert_allclose(np.asarray(got), last.astype(np.float64) @ score, rtol=1e-4, atol=1e-4)
    f = _pairs_file(tmp_path, rows)
    argv = ["reward-model", "--model.path", str(GGUF), "--pairs", str(f), "--out", str(tmp_path / "o"),
            "--rm.head_only", "true", "--lora.rank", "2"]  # fmt: skip
    assert "--lora.rank: must be 0 with --rm.head_only" in one_line_error(capsys, klrl_main, argv)


# ---- one text format from the reward model to PPO -------------------------------------------------------
def _ppo_reward_inputs(tok, prompt_file: Path, responses: list[str], P: int, R: int):
    """What PPO's reward model reads for these prompts and sampled responses: the prompts through PPO's
    own pool (:func:`klrl.data.prompts.load_prompts`, its defaults: the chat template), each response as
    the sampler leaves it (its ids, the end token where it stopped, cut at R), and
    ``sequence(prompt, prompt_mask, response, mask)`` as :func:`klrl.tasks.text.model_reward` builds it."""
    from klrl.config import DataConfig
    from klrl.data.prompts import load_prompts
    from klrl.models.rollout import sequence

    pool = load_prompts(DataConfig(path=str(prompt_file), prompt_len=P), tok).train
    response = np.full((len(responses), R), tok.pad_id, np.int32)
    mask = np.zeros((len(responses), R), np.float32)
    for i, text in enumerate(responses):
        ids = (tok.encode(text) + [tok.stop_ids[0]])[:R]  # sampled up to the stop token, or cut at R
        response[i, : len(ids)], mask[i, : len(ids)] = ids, 1.0
    tokens, key_mask = sequence(pool.tokens, pool.mask, response, mask)
    ro = Rollout(pool.tokens, pool.mask, response, mask, None, None, None)
    real = [np.asarray(t)[np.concatenate([pm, m]) > 0].tolist()
            for t, pm, m in zip(np.asarray(tokens), pool.mask, mask, strict=True)]  # fmt: skip
    assert np.asarray(key_mask).shape == (len(responses), P + R)
    return ro, real


def test_reward_trainer_and_ppo_see_the_same_token_ids_and_scores(trained, tmp_path):
    """The token ids ``klrl reward-model`` trains on for a (prompt, response) are the real tokens PPO's
    reward model reads for that prompt and completion (chat template, stop token, both truncations), and
    ``klrl.load_reward_model(DIR).score`` equals PPO's ``--model.reward_path`` reward of the rollout.
    The old default layout (raw ``prompt + response``, ``encode_pairs``) differs."""
    import klrl
    from klrl.config import DataConfig, SamplingConfig
    from klrl.rewards.pairs import encode_as_ppo

    tok, P, R = trained["tok"], 24, 5
    prompts = ["ab cd", "ef " * 40, "gh"]  # the second one longer than P: cut inside the user content
    responses = ["yes", "ij kl mn op", "kl"]  # the second one longer than R: cut, no stop token
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    ro, want = _ppo_reward_inputs(tok, f, responses, P, R)
    rows = [{"prompt": p, "chosen": r, "rejected": r} for p, r in zip(prompts, responses, strict=True)]
    pairs = encode_as_ppo(rows, tok, DataConfig(prompt_len=P), SamplingConfig(response_len=R))
    got = [row[m > 0].tolist() for row, m in zip(pairs.chosen, pairs.chosen_mask, strict=True)]
    assert got == want
    assert want[0][-1] == tok.stop_ids[0] and want[1][-1] != tok.stop_ids[0]  # cut at R: no stop
    assert pairs.truncated == 1 and pairs.chosen.shape == (3, P + R)
    old = encode_pairs(rows, tok, P + R)
    assert [row[m > 0].tolist() for row, m in zip(old.chosen, old.chosen_mask, strict=True)] != want
    # the scores: PPO's reward of the rollout == klrl.load_reward_model(DIR).score(prompts, responses)
    model, params = reward_model(RunConfig(model=ModelConfig(reward_path=str(trained["out"]))))
    r = model_reward(model, params)
    ppo = np.asarray(jax.jit(r.fn)(r.params, ro))
    rm = klrl.load_reward_model(trained["out"])
    assert (rm.data, rm.sampling) == (DataConfig(), SamplingConfig())  # none recorded: the defaults
    rm = dataclasses.replace(rm, data=DataConfig(prompt_len=P), sampling=SamplingConfig(response_len=R))
    np.testing.assert_allclose(rm.score(prompts, responses, batch_size=2), ppo, atol=1e-4)
    assert [t[m > 0].tolist() for t, m in zip(*rm.encode(prompts, responses), strict=True)] == want


def test_the_causal_lm_loader_names_the_reward_model_call(trained):
    from klrl.models.hf import CheckpointFormatError

    with pytest.raises(CheckpointFormatError) as e:
        from_pretrained(trained["out"])
    msg = str(e.value)
    assert "klrl.load_reward_model(" in msg and "--model.reward_path" in msg and "\n" not in msg


def test_ppo_notes_a_reward_model_trained_on_another_text_format(trained, tmp_path):
    """The text task adds one note (logged once the run's checks pass) when ``model.reward_path``'s
    ``reward_model.json`` records another text format than the run's ``data`` / ``sampling`` fields."""
    import shutil

    from klrl.rewards.model import format_mismatch
    from klrl.tasks.text import make_text_task

    rm = tmp_path / "rm"
    shutil.copytree(trained["out"], rm)
    fmt = {"chat_template": True, "prompt_len": 64, "truncate": "left", "response_len": 16, "use_eos": True}
    (rm / "reward_model.json").write_text(json.dumps({"text_format": {**fmt, "end_token": "<|im_end|>"}}))
    cfg = RunConfig.from_dict({"model": {"path": str(GGUF), "reward_path": str(rm)}, "task": {"name": "text"},
                               "data": {"limit": 2}, "sampling": {"response_len": 8}})  # fmt: skip
    notes = [n for n in make_text_task(cfg).info.get("notes", []) if "reward_path" in n]
    assert len(notes) == 1 and "sampling.response_len 16 (this run: 8)" in notes[0], notes
    assert "data.prompt_len" not in notes[0]
    assert format_mismatch(rm, cfg.data, cfg.sampling.__class__(response_len=16)) is None
    assert format_mismatch(trained["out"], cfg.data, cfg.sampling) is None  # nothing recorded
    # the same format: one line saying it matches, with the fields compared (issue 48: it said nothing)
    same = cfg.replace(sampling={"response_len": 16})
    notes = [n for n in make_text_task(same).info.get("notes", []) if "reward_path" in n]
    assert notes == [
        f"model.reward_path {rm}: text format matches the one it was trained on (data.chat_template "
        "True, data.prompt_len 64, data.truncate 'left', sampling.response_len 16, sampling.use_eos "
        "True)"
    ]
    none = cfg.replace(model={"reward_path": str(trained["out"])})
    notes = [n for n in make_text_task(none).info.get("notes", []) if "reward_path" in n]
    assert len(notes) == 1 and "no text format recorded" in notes[0], notes


def test_heldout_warning_below_50_pairs():
    """The Wilson interval against hand values (n=2, p=1: centre (1 + 0.96)/2.92, half-width
    1.96/2.92 * sqrt(3.8416/16)); the warning from 49 pairs down, none at 50."""
    from klrl.rewards.train import MIN_HELDOUT, heldout_warning, wilson_interval

    z2 = 1.96**2
    lo, hi = wilson_interval(1.0, 2)
    centre, half = (1 + z2 / 4) / (1 + z2 / 2), 1.96 / (1 + z2 / 2) * np.sqrt(z2 / 16)
    assert (lo, hi) == pytest.approx((centre - half, min(1.0, centre + half)))
    assert lo == pytest.approx(0.342, abs=1e-3) and hi == 1.0
    lo, hi = wilson_interval(0.8, 100)  # Brown, Cai & DasGupta's example scale: about 0.71 .. 0.87
    assert (round(lo, 3), round(hi, 3)) == (0.711, 0.867)
    assert MIN_HELDOUT == 50 and heldout_warning(0.9, 50) is None
    line = heldout_warning(1.0, 2)
    assert line == (
        "warning: the held-out accuracy 1.000 rests on 2 pairs (fewer than 50): its 95% interval is "
        "[0.34, 1.00] (Wilson); more pairs or a larger --rm.eval_fraction narrow it"
    )


def test_config_of_the_ppo_run_gives_the_text_format_and_flags_override_it(tmp_path):
    """``--config FILE`` (the PPO run's config) supplies data.*, sampling.* and model.path; a flag wins."""
    from klrl.cli.reward_model import parse_args, text_configs

    f = tmp_path / "ppo.yaml"
    f.write_text(f"model: {{path: {GGUF}}}\ndata: {{prompt_len: 12, chat_template: false}}\n"
                 "sampling: {response_len: 3, use_eos: false}\n")  # fmt: skip
    ns = parse_args(["--config", str(f), "--pairs", "p", "--out", "o", "--sampling.response_len", "5"])
    data, sampling = text_configs(ns)
    assert (data.prompt_len, data.chat_template, sampling.response_len, sampling.use_eos) == (
        12,
        False,
        5,
        False,
    )
    assert ns.model_path == str(GGUF) and ns.deprecated == []


def test_train_head_on_precomputed_features_is_head_only_training():
    """``train_head`` on features computed once per sequence (NumPy gather of the base's last hidden state,
    ``forward`` on the unpadded sequences) gives the score vector and history ``train(head_only=True)`` gives
    on the pairs themselves."""
    from klrl.rewards.train import train_head

    model, base, tok = from_pretrained(GGUF)
    rows = marker_pairs(24)
    pairs = encode_pairs(rows, tok, 16)
    tr, ev = split(len(rows), 0.25, 0)
    s = TrainSettings(epochs=3, lr=3e-2, batch_size=6, seed=1)
    _, want, hist = train(model, base, pairs.take(tr), pairs.take(ev), s, head_only=True)

    def feats(tokens, mask):
        out = []
        for t, m in zip(tokens, mask, strict=True):
            real = jnp.asarray(t[m > 0])[None]
            out.append(
                np.asarray(forward(model, base, real, jnp.ones_like(real), logits=False).hidden[0, -1])
            )
        return np.stack(out).astype(np.float32)

    f = {k: feats(getattr(pairs, k), getattr(pairs, f"{k}_mask")) for k in ("chosen", "rejected")}
    got, hist2 = train_head(
        model, (f["chosen"][tr], f["rejected"][tr]), (f["chosen"][ev], f["rejected"][ev]), s
    )
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    assert [h["epoch"] for h in hist2] == [1, 2, 3]
    np.testing.assert_allclose([h["loss"] for h in hist2], [h["loss"] for h in hist], rtol=1e-3)
    assert np.abs(want).max() > 0


def test_a_response_that_stopped_at_once_is_scored_as_ppo_scores_it(trained, tmp_path):
    """An empty completion (the sampler's first token was the stop token): ``RewardModel.score`` reads the
    prompt and the end token, as PPO's reward of that rollout does; a pairs file still refuses it."""
    import klrl
    from klrl.config import DataConfig, SamplingConfig
    from klrl.rewards.pairs import PairsError, check_pairs

    tok, P, R = trained["tok"], 24, 5
    prompts, responses = ["ab cd", "gh"], ["", "kl"]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    ro, want = _ppo_reward_inputs(tok, f, responses, P, R)
    assert want[0][-1] == tok.stop_ids[0] and want[0][-2] != tok.stop_ids[0]  # the prompt, then the stop
    model, params = reward_model(RunConfig(model=ModelConfig(reward_path=str(trained["out"]))))
    r = model_reward(model, params)
    ppo = np.asarray(jax.jit(r.fn)(r.params, ro))
    rm = dataclasses.replace(klrl.load_reward_model(trained["out"]), data=DataConfig(prompt_len=P),
                             sampling=SamplingConfig(response_len=R))  # fmt: skip
    assert [t[m > 0].tolist() for t, m in zip(*rm.encode(prompts, responses), strict=True)] == want
    np.testing.assert_allclose(rm.score(prompts, responses), ppo, atol=1e-4)
    with pytest.raises(PairsError, match="empty"):
        check_pairs([{"prompt": "x", "chosen": "", "rejected": "y"}], ["row 0"])

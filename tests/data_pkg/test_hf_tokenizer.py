"""klrl.data.hf_tokenizer: the byte alphabet, directory load/save, stop ids, chat templates rendered
as transformers renders them (hand-written expected strings), errors. Token ids against
transformers' are in test_gguf.py (tiny GGUF vocabulary and SmolLM2)."""

from __future__ import annotations

import json

import jinja2
import pytest

from klrl.data.hf_tokenizer import (
    HFTokenizer,
    TokenizerFormatError,
    byte_level_bpe,
    bytes_to_unicode,
    load_tokenizer_dir,
    make_tokenizer,
)
from klrl.data.tokenizer import Tokenizer

CHARS = list(bytes_to_unicode().values())
SPECIAL = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": None, "unk_token": None}


def tok(template=None, **kw) -> HFTokenizer:
    t = byte_level_bpe(
        CHARS + ["he", "hel", "<s>", "<|im_end|>", "<|endoftext|>"], ["h e", "he l"], [1] * 258 + [3, 3, 3]
    )
    return make_tokenizer(t, SPECIAL, template, **kw)


def test_byte_alphabet_is_a_bijection_keeping_printable_ascii():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert m[ord("A")] == "A" and m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ"


def test_protocol_encode_decode_and_stop_ids():
    t = tok()
    assert isinstance(t, Tokenizer)
    assert t.encode("hello") == [257, ord("l") - 0x21, ord("o") - 0x21]  # 'hel' merged, then bytes
    assert t.decode(t.encode("naïve 東京 🚀")) == "naïve 東京 🚀"
    assert t.encode("x<|im_end|>")[-1] == 259 and t.decode([259]) == ""
    assert t.decode([259], skip_special_tokens=False) == "<|im_end|>"
    # EOS first, then end-of-turn tokens found among the specials; no pad token: pad = EOS
    assert t.stop_ids == (259, 260) and t.pad_id == 259 and t.bos_id == 258
    assert tok(add_bos=True).encode("he", add_special_tokens=True) == [258, 256]


def test_chat_template_rendered_like_transformers():
    # trim_blocks + lstrip_blocks, loopcontrols, tojson without HTML escaping, bos_token in scope
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
        "<{{ m['role'] }}>{{ m['content'] | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    t = tok(template)
    msgs = [
        {"role": "user", "content": "a<b>&"},
        {"role": "skip", "content": "x"},
        {"role": "system", "content": "é"},
    ]
    assert t.apply_chat_template(msgs) == '<s><user>"a<b>&"\n<system>"é"\n<assistant>'
    assert t.apply_chat_template(msgs, add_generation_prompt=False) == '<s><user>"a<b>&"\n<system>"é"\n'
    with pytest.raises(jinja2.TemplateError, match="no system"):
        tok("{{ raise_exception('no system') }}").apply_chat_template(msgs)
    with pytest.raises(ValueError, match="no chat template"):
        tok().apply_chat_template(msgs)


def test_save_and_load_directory(tmp_path):
    t = tok("{{ messages[0]['content'] }}")
    t.save(tmp_path)
    back = load_tokenizer_dir(tmp_path)
    assert back.encode("hello<|im_end|>") == t.encode("hello<|im_end|>")
    assert (back.stop_ids, back.pad_id, back.bos_id, back.chat_template) == (
        t.stop_ids,
        t.pad_id,
        t.bos_id,
        t.chat_template,
    )
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_transformers5_layout_template_file_and_generation_config(tmp_path):
    tok().save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|endoftext|>", "special": True}  # the dict form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 260]}))
    t = load_tokenizer_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    assert t.stop_ids == (260, 258, 259)  # EOS, generation_config, end-of-turn specials


def test_missing_or_broken_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerFormatError, match="tokenizer.json: missing"):
        load_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFormatError, match="tokenizer.json: not a readable"):
        load_tokenizer_dir(tmp_path)


def test_chat_format_reads_added_turn_tokens_that_are_not_special():
    """Gemma-shaped: the turn tokens are added but not special (GGUF user-defined, type 4), so they
    survive skip_special_tokens; they are still the template's markers, so a prompt that carries the
    template without its BOS is detected, and a long one is cut between the user header and the end
    of turn (the generation prompt kept)."""
    from klrl.config import DataConfig
    from klrl.data.prompts import build_pool, chat_format

    t = byte_level_bpe(
        CHARS + ["<s>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"], [], [1] * 256 + [3, 3, 4, 4]
    )
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    g = make_tokenizer(t, SPECIAL, template)
    assert g.added_tokens == {"<s>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"}
    assert g.decode(g.encode("<start_of_turn>"), skip_special_tokens=True) == "<start_of_turn>"  # not special
    fmt = chat_format(g)
    assert set(fmt.markers) == {"<s>", "<start_of_turn>", "<end_of_turn>"}
    assert fmt.user_header == "<start_of_turn>user\n"
    head, tail = "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"
    content = "abcdefghij" * 3
    pool = build_pool([{"prompt": head + content + tail}], g, DataConfig(prompt_len=24), source="mem")
    assert pool.n_templated == 1 and pool.n_truncated == 1
    ids = (
        g.encode(head)
        + g.encode(content)[-(24 - len(g.encode(head)) - len(g.encode(tail))) :]
        + g.encode(tail)
    )
    assert [int(i) for i in pool.tokens[0]] == ids
    assert g.decode(ids, skip_special_tokens=False).endswith("ghij" + tail)

"""klrl.models.pretrained.text_model: a model that reads and writes text, or one ValueError naming the
path and the cause (klrl.dpo, klrl eval's SOURCE and klrl reward-model each prefix their field)."""

from __future__ import annotations

from pathlib import Path

import pytest

from klrl.models.pretrained import from_pretrained, save_pretrained, text_model

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"


def test_a_gguf_reads_with_its_tokenizer():
    model, params, tok = text_model(GGUF)
    assert tok is not None and tok.vocab_size == model.vocab_size


def test_an_hf_directory_without_a_tokenizer_is_one_error(tmp_path):
    model, params, _ = from_pretrained(GGUF)
    save_pretrained(model, params, None, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match=r"hf: no tokenizer \(an HF directory needs tokenizer.json\)"):
        text_model(tmp_path / "hf")


def test_an_unreadable_checkpoint_is_a_value_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        text_model(tmp_path / "empty")

"""The tokenizer interface: text <-> token ids, a pad id and a *set* of stop ids.

A response ends at the first token in ``stop_ids`` (chat models have several: an EOS and one or
more end-of-turn tokens). Families of tokenizers (klrl's synthetic word vocabularies, Hugging Face
``tokenizers`` files, GGUF metadata) implement :class:`Tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int  # number of token ids (may be below the model's embedding rows)
    pad_id: int
    stop_ids: tuple[int, ...]  # any of these ends a response (kept, mask 1)
    bos_id: int | None
    chat_template: str | None  # a Jinja chat template, if the tokenizer has one

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered to text (raise ``ValueError`` if there is none)."""
        ...

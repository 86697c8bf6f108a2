"""A word-level :class:`klrl.data.tokenizer.Tokenizer` over a fixed word list (klrl's synthetic
languages and id-only benchmark vocabularies): one id per word, text is words joined by spaces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WordTokenizer:
    words: tuple[str, ...]  # word of each id
    pad_id: int
    stop_ids: tuple[int, ...]
    bos_id: int | None = None
    chat_template: str | None = None
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        if not self.stop_ids:
            raise ValueError("tokenizer: at least one stop id is needed")
        bad = [i for i in (self.pad_id, *self.stop_ids) if not 0 <= i < len(self.words)]
        if bad:
            raise ValueError(f"tokenizer: ids {bad} are outside the vocabulary of {len(self.words)} words")
        object.__setattr__(self, "_index", {w: i for i, w in enumerate(self.words)})

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset({self.pad_id, *self.stop_ids, *(() if self.bos_id is None else (self.bos_id,))})

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = [self._index[w] for w in text.split()]
        return ([self.bos_id] if add_special_tokens and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        special = self.special_ids if skip_special_tokens else frozenset()
        return " ".join(self.words[int(i)] for i in ids if int(i) not in special)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        raise ValueError("this word tokenizer has no chat template")

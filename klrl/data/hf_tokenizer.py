"""Hugging Face tokenizers behind :class:`klrl.data.tokenizer.Tokenizer`, over the ``tokenizers``
library (no transformers, no torch).

* :func:`load_tokenizer_dir`: ``tokenizer.json`` + ``tokenizer_config.json`` (special tokens,
  ``chat_template``, or a ``chat_template.jinja`` file as transformers 5 writes it) and, if present,
  ``generation_config.json`` (its ``eos_token_id``, one id or a list, joins the stop ids).
* :func:`byte_level_bpe`: a GPT-2-style byte-level BPE rebuilt from a vocabulary and merges as a
  GGUF stores them, the way transformers' GGUF loader builds it
  (``integrations/gguf/gguf_tokenizer_mapping.byte_level_tokenizer``).
* :func:`gemma_bpe`: Gemma's SentencePiece vocabulary as a GGUF stores it (``tokenizer.ggml.model =
  llama``, no merges), rebuilt as transformers' GGUF loader does (``gemma_tokenizer``): BPE with byte
  fallback over ``GemmaTokenizer``'s normalizer, pre-tokenizer and decoder, merges recovered from the
  vocabulary in its file order.
* Chat templates are rendered with jinja2's sandbox configured as transformers does
  (``utils/chat_template_utils._cached_compile_jinja_template``: ``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Tok

# end-of-turn tokens of common chat formats: stop ids whenever the vocabulary has them as specials
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>")

# pre-tokenizer splits by GGUF ``tokenizer.ggml.pre`` (transformers' GGUF_PRE_TOKENIZER_SPLITS subset)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


class TokenizerFormatError(ValueError):
    """A tokenizer file that cannot be used; the message is one line naming the file and field."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``openai/gpt-2 encoder.py``)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@lru_cache(maxsize=16)
def _template(source: str):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclasses.dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with klrl's pad id, stop-id set, BOS and chat template."""

    tok: _Tok
    pad_id: int
    stop_ids: tuple[int, ...]
    bos_id: int | None = None
    chat_template: str | None = None
    special: dict = dataclasses.field(default_factory=dict)  # bos_token/eos_token/unk_token/pad_token strings
    add_bos: bool = False  # prepend BOS when ``add_special_tokens`` (GGUF ``add_bos_token``)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def added_tokens(self) -> frozenset[str]:
        """Every added token's text, special or not (GGUF control and user-defined tokens, a
        ``tokenizer.json``'s ``added_tokens``): the markers a chat template may write
        (:func:`klrl.data.chat.chat_format`)."""
        return frozenset(a.content for a in self.tok.get_added_tokens_decoder().values())

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        kw = {k: v for k, v in self.special.items() if v is not None}
        return _template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kw
        )

    def save(self, out_dir: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` as transformers reads them."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(out / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
            **{k: v for k, v in self.special.items() if v is not None},
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def make_tokenizer(
    tok: _Tok, special: dict, chat_template: str | None, extra_stops=(), add_bos=False
) -> HFTokenizer:
    """Ids from the special-token strings; stop ids = EOS, ``extra_stops`` and the end-of-turn
    tokens (:data:`END_OF_TURN`) the vocabulary holds as special tokens."""
    ids = {k: (tok.token_to_id(v) if v is not None else None) for k, v in special.items()}
    specials = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    stops = [ids.get("eos_token"), *extra_stops]
    stops += [tok.token_to_id(t) for t in END_OF_TURN if t in specials]
    stops = tuple(dict.fromkeys(i for i in stops if i is not None))
    pad = ids.get("pad_token")
    pad = pad if pad is not None else (stops[0] if stops else 0)
    return HFTokenizer(tok, pad, stops, ids.get("bos_token"), chat_template, dict(special), add_bos)


def load_tokenizer_dir(path: str | Path) -> HFTokenizer:
    """A tokenizer from an HF model directory (see the module docstring)."""
    path = Path(path)
    f = path / "tokenizer.json"
    if not f.is_file():
        raise TokenizerFormatError(f"{f}: missing")
    try:
        tok = _Tok.from_file(str(f))
    except Exception as e:
        raise TokenizerFormatError(
            f"{f}: not a readable tokenizers file ({str(e).splitlines()[0]})"
        ) from None
    cfg = {}
    cf = path / "tokenizer_config.json"
    if cf.is_file():
        try:
            cfg = json.loads(cf.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerFormatError(f"{cf}: not valid JSON ({e})") from None
    special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jf = path / "chat_template.jinja"
    if template is None and jf.is_file():
        template = jf.read_text()
    extra = []
    gf = path / "generation_config.json"
    if gf.is_file():
        eos = json.loads(gf.read_text()).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
    return make_tokenizer(tok, special, template, extra, bool(cfg.get("add_bos_token", False)))


def byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] = (), pre: str | None = None
) -> _Tok:
    """Byte-level BPE from a GGUF-style vocabulary, merges (``"a b"`` strings) and token types
    (3 = control: added as special tokens; 4 = user-defined: added as plain added tokens)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tok = _Tok(bpe)
    split = PRE_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _gguf_added_tokens(tok, tokens, token_types, lambda t: set(t) <= alphabet, lambda t: t in vocab)
    return tok


def _gguf_added_tokens(tok: _Tok, tokens: Sequence[str], token_types: Sequence[int], control_ok, user_ok):
    """GGUF control tokens (type 3) as special added tokens, user-defined ones (type 4) as plain
    added tokens (llama.cpp matches both whole in text), those ``control_ok`` / ``user_ok`` keep
    (transformers' ``add_gguf_special_tokens``)."""
    for kind, ok, special, add in (
        (3, control_ok, True, tok.add_special_tokens),
        (4, user_ok, False, tok.add_tokens),
    ):
        added = [
            AddedToken(t, normalized=False, special=special)
            for t, ty in zip(tokens, token_types, strict=False)
            if ty == kind and ok(t)
        ]
        if added:
            add(added)


def _merges_in_file_order(vocab: dict[str, int], order: dict[str, int]) -> list[tuple[str, str]]:
    """Every split ``(l, r)`` of a token with both halves in ``vocab``, ordered by the token's
    ``order`` (its last position in the file), then longer left halves first (transformers'
    ``generate_merges`` with the scores ``-position``)."""
    found = []
    for token, pos in order.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                found.append((pos, -i, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def gemma_bpe(tokens: Sequence[str], token_types: Sequence[int] = (), unk: str | None = "<unk>") -> _Tok:
    """Gemma's SentencePiece vocabulary from a GGUF (module docstring): tokens of two or more
    blanks are respelled with ``\u2581`` (the file stores them as real spaces), the merges are
    every split of a token into two tokens, in the order of the tokens in the file."""
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_in_file_order(vocab, vocab),
        fuse_unk=True,
        unk_token=unk or "<unk>",
        dropout=None,
        byte_fallback=True,
    )
    tok = _Tok(bpe)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    _gguf_added_tokens(tok, tokens, token_types, lambda t: True, lambda t: t in vocab)
    return tok

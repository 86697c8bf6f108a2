"""The chat template around a prompt: rendering a string or a conversation (:func:`render`), finding
what the template writes (:func:`chat_format`: its marker tokens and the user header, so a prompt
that already carries the template is not wrapped again), and cutting a long prompt inside its user
content, keeping the template and the generation prompt (:func:`shorten`). The rules are
:mod:`klrl.data.prompts`' module docstring's; this module is its template half.

Errors are :class:`PromptDataError` with one line naming the prompt (its file and row).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from klrl.config import DataConfig
from klrl.data.tokenizer import Tokenizer


def one_line(e: BaseException) -> str:
    """``Type: message`` on one line (a multi-line message joined with " / ")."""
    return f"{type(e).__name__}: {' / '.join(x.strip() for x in str(e).splitlines() if x.strip())}"


class PromptDataError(ValueError):
    """A prompt file or its content is unusable. The message names the file (and row or column)."""


def _messages(value: Any, label: str) -> list[dict[str, str]] | None:
    """``value`` as a conversation, None for a string; a malformed one is an error."""
    if isinstance(value, str):
        return None
    if (
        isinstance(value, list | tuple)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise PromptDataError(
        f"{label}: expected a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


def render(value: Any, tokenizer: Tokenizer, chat_template: bool, label: str) -> str:
    """The text to encode for one prompt value (see the module docstring)."""
    msgs = _messages(value, label)
    if not chat_template:
        if msgs is not None:
            raise PromptDataError(f"{label}: a conversation needs data.chat_template true")
        return value
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptDataError(f"{label}: the tokenizer has no chat template; set data.chat_template false")
    try:
        return tokenizer.apply_chat_template(
            msgs if msgs is not None else [{"role": "user", "content": value}], add_generation_prompt=True
        )
    except Exception as e:  # jinja2's TemplateError, or whatever the template raises
        raise PromptDataError(f"{label}: the chat template failed ({one_line(e)})") from None


# a message content the templates write through unchanged (no spaces for `trim`, no markup)
_PROBE = "KLRLPROBE{}Z"


@dataclass(frozen=True)
class ChatFormat:
    """What a tokenizer's chat template writes around a message: ``markers``, the special tokens it
    emits (longest first), and ``user_header``, the text from the marker that opens a user turn up
    to the user's content (``<|im_start|>user\\n``; None where no marker precedes a ``user`` role)."""

    markers: tuple[str, ...]
    user_header: str | None

    def carries(self, text: str) -> bool:
        """Whether ``text`` already carries the template (contains one of its markers)."""
        return any(m in text for m in self.markers)


def chat_format(tokenizer: Tokenizer) -> ChatFormat | None:
    """The :class:`ChatFormat` of ``tokenizer``'s chat template, read off a rendered one-message
    conversation: a marker is a token of the rendering that decodes to nothing once special tokens
    are skipped, or one of the tokenizer's ``added_tokens`` where it lists them (a template's turn
    tokens need not be special, e.g. a GGUF's user-defined ones). None without a template (or one
    that cannot render the probe)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    probe = _PROBE.format(0)
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], add_generation_prompt=True)
    except Exception:  # a template that rejects the probe: no detection, the prompts are rendered as usual
        return None
    found, added = set(), getattr(tokenizer, "added_tokens", frozenset())
    for i in tokenizer.encode(text):
        raw = tokenizer.decode([i], skip_special_tokens=False)
        if raw and raw in text and (raw in added or not tokenizer.decode([i], skip_special_tokens=True)):
            found.add(raw)
    markers = tuple(sorted(found, key=lambda m: (-len(m), m)))
    at, header = text.find(probe), None
    starts = sorted({k for m in markers for k in _find_all(text[:at], m)}, reverse=True)
    for k in starts:  # the nearest marker before the content whose text names the user role
        if "user" in text[k:at].lower():
            header = text[k:at]
            break
    return ChatFormat(markers, header)


def _find_all(text: str, sub: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(sub), text)]


Segments = list[tuple[str, bool]]  # (text, True where it is user content that may be shortened)


def _templated_segments(text: str, fmt: ChatFormat) -> Segments | None:
    """A string that carries the template, split around its user contents: each starts after the
    user header and ends at the next marker. None where it has no user header."""
    if not fmt.user_header:
        return None
    segs: Segments = []
    pos = 0
    while (h := text.find(fmt.user_header, pos)) >= 0:
        start = h + len(fmt.user_header)
        ends = [e for m in fmt.markers if (e := text.find(m, start)) >= 0]
        end = min(ends) if ends else len(text)
        segs += [(text[pos:start], False), (text[start:end], True)]
        pos = end
    return segs + [(text[pos:], False)] if segs else None


def _rendered_segments(msgs: list[dict[str, str]], text: str, tokenizer: Tokenizer) -> Segments | None:
    """``text`` (the template's rendering of ``msgs``) split around its user messages' contents: the
    template is rendered again with a probe for each user content, and ``text`` must read as the
    same pieces around the contents (a template that trims them is fine). None otherwise."""
    users = [j for j, m in enumerate(msgs) if m["role"] == "user"]
    if not users:
        return None
    probe = [dict(m, content=_PROBE.format(j)) if j in users else m for j, m in enumerate(msgs)]
    try:
        rendered = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except Exception:
        return None
    fixed, pos = [], 0
    for j in users:
        s = _PROBE.format(j)
        k = rendered.find(s, pos)
        if k < 0 or rendered.count(s) != 1:
            return None
        fixed.append(rendered[pos:k])
        pos = k + len(s)
    fixed.append(rendered[pos:])
    pattern = "(.*?)".join(re.escape(f) for f in fixed)
    found = re.fullmatch(pattern, text, flags=re.DOTALL)
    if found is None:
        return None
    segs: Segments = []
    for f, c in zip(fixed, found.groups(), strict=False):
        segs += [(f, False), (c, True)]
    return segs + [(fixed[-1], False)]


def _around(tokenizer: Tokenizer, text: str, add_special: bool) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after ``text``'s own with ``add_special_tokens`` (a BOS)."""
    if not add_special:
        return [], []
    whole, bare = list(tokenizer.encode(text, add_special_tokens=True)), list(tokenizer.encode(text))
    for k in range(len(whole) - len(bare) + 1):
        if whole[k : k + len(bare)] == bare:
            return whole[:k], whole[k + len(bare) :]
    return [], []


def _cut(
    segs: Segments, around: tuple[list[int], list[int]], P: int, tokenizer: Tokenizer, label: str
) -> list[int]:
    """The ids of ``segs`` (each encoded alone) with the first tokens of the user contents dropped
    (the earliest content first) until ``P`` remain. The template's pieces are never cut: where they
    take ``P`` tokens or more it is an error."""
    lead, trail = around
    enc = [list(tokenizer.encode(t)) if t else [] for t, _ in segs]
    fixed = len(lead) + len(trail) + sum(len(e) for e, (_, user) in zip(enc, segs, strict=True) if not user)
    if fixed >= P:
        raise PromptDataError(
            f"{label}: the chat template around the user message alone takes {fixed} tokens, no room left "
            f"in data.prompt_len = {P}; raise data.prompt_len (or set data.chat_template false)"
        )
    excess = len(lead) + len(trail) + sum(map(len, enc)) - P
    out = list(lead)
    for e, (_, user) in zip(enc, segs, strict=True):
        if user and excess > 0:
            k = min(excess, len(e))
            e, excess = e[k:], excess - k
        out += e
    return out + list(trail)


def shorten(
    value: Any, text: str, templated: bool, tokenizer: Tokenizer, cfg: DataConfig, fmt: ChatFormat | None,
    label: str, n: int,
) -> list[int]:  # fmt: skip
    """The ids of a prompt of ``n > P`` tokens, cut inside its user content (module docstring)."""
    P = cfg.prompt_len
    if cfg.truncate == "error":
        raise PromptDataError(
            f"{label}: prompt has {n} tokens, more than data.prompt_len = {P} (data.truncate = 'error')"
        )
    if templated:
        segs = _templated_segments(text, fmt)
    elif cfg.chat_template:
        msgs = _messages(value, label) or [{"role": "user", "content": value}]
        segs = _rendered_segments(msgs, text, tokenizer)
    else:
        segs = [(text, True)]
    if segs is None:
        what = "its user message cannot be found in the chat template's text"
        raise PromptDataError(
            f"{label}: prompt has {n} tokens, more than data.prompt_len = {P}, and {what} to shorten it "
            "there; raise data.prompt_len or shorten the prompt"
        )
    return _cut(segs, _around(tokenizer, text, not cfg.chat_template), P, tokenizer, label)

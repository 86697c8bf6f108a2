"""klrl.data.chat: what a chat template writes, rendering, and cutting a prompt inside its user content.

References are written out by hand: the ChatML text literally, encoded piece by piece by the test
tokenizer (tests/texttok.py, SmolLM2's template), never by the module under test.
"""

from __future__ import annotations

import pytest
from texttok import make_tokenizer

from klrl.config import DataConfig
from klrl.data.chat import PromptDataError, chat_format, render, shorten

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
USER, END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
CONTENT = "the cat sat on the mat and the dog sat on the log " * 3 + "What is 17 + 25?"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_chat_format_of_chatml(tok) -> None:
    fmt = chat_format(tok)
    assert fmt.markers == ("<|im_start|>", "<|im_end|>") and fmt.user_header == USER
    assert fmt.carries(SYSTEM + USER + "hi" + END) and not fmt.carries("hi <im_start> there")
    assert chat_format(make_tokenizer(None)) is None


def test_render_wraps_a_string_in_one_user_turn(tok) -> None:
    assert render("hi", tok, True, "row 0") == SYSTEM + USER + "hi" + END
    assert render("hi", tok, False, "row 0") == "hi"
    with pytest.raises(PromptDataError, match=r"^row 3: a conversation needs data.chat_template true"):
        render([{"role": "user", "content": "hi"}], tok, False, "row 3")
    with pytest.raises(PromptDataError, match=r"^row 1: the tokenizer has no chat template"):
        render("hi", make_tokenizer(None), True, "row 1")


@pytest.mark.parametrize("templated", [False, True])
def test_shorten_drops_the_first_tokens_of_the_user_content(tok, templated) -> None:
    text = SYSTEM + USER + CONTENT + END
    head, body, tail = tok.encode(SYSTEM + USER), tok.encode(CONTENT), tok.encode(END)
    n = len(head) + len(body) + len(tail)
    P = n - 5
    ids = shorten(CONTENT if not templated else text, text, templated, tok, DataConfig(prompt_len=P),
                  chat_format(tok), "row 0", n)  # fmt: skip
    assert ids == head + body[5:] + tail and len(ids) == P
    with pytest.raises(PromptDataError, match=r"^row 0: prompt has \d+ tokens, more than data.prompt_len"):
        shorten(CONTENT, text, False, tok, DataConfig(prompt_len=P, truncate="error"), None, "row 0", n)


def test_the_template_alone_over_the_budget_is_one_line(tok) -> None:
    text = SYSTEM + USER + CONTENT + END
    fixed = len(tok.encode(SYSTEM + USER)) + len(tok.encode(END))
    with pytest.raises(PromptDataError, match=rf"^row 2: the chat template .* takes {fixed} tokens"):
        shorten(CONTENT, text, False, tok, DataConfig(prompt_len=fixed), chat_format(tok), "row 2", 99)

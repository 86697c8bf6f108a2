"""A real, small tokenizer for the text tests: a byte-level BPE trained here on a few sentences
(``tokenizers``), with ChatML special tokens and SmolLM2-135M-Instruct's chat template (copied from
its GGUF metadata), rendered with jinja2 the way transformers renders chat templates (a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

CORPUS = [
    "What is 17 + 25? The answer is 42.",
    "Write a short review of a quiet beach. It was lovely, calm and wonderful.",
    "Describe a rainy afternoon in one sentence. The rain was awful and the day was sad.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "system user assistant hello world good bad happy terrible great",
    "the cat sat on the mat and the dog sat on the log",
] * 4


class TextTokenizer:
    """The ``klrl.data.tokenizer.Tokenizer`` protocol around a ``tokenizers.Tokenizer``."""

    def __init__(self, tok, chat_template: str | None = SMOLLM2_CHAT_TEMPLATE):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.pad_id = tok.token_to_id("<|endoftext|>")
        self.stop_ids = (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))
        self.bos_id = None
        self.chat_template = chat_template

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, eos_token="<|endoftext|>"
        )


@lru_cache(maxsize=1)
def _trained():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


def make_tokenizer(chat_template: str | None = SMOLLM2_CHAT_TEMPLATE) -> TextTokenizer:
    from tokenizers import Tokenizer

    return TextTokenizer(Tokenizer.from_str(_trained()), chat_template)

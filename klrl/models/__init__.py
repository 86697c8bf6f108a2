"""Model families behind one causal-LM interface (:mod:`klrl.models.base`).

Pretrained checkpoints: :func:`from_pretrained` (an HF directory or a GGUF file ->
``(model, params, tokenizer)``), :func:`save_pretrained` (an HF directory transformers loads),
:func:`generate_text`; failures raise :class:`CheckpointFormatError` (one line).
"""

from klrl.models.base import CausalLM, LMOutput, causal_mask, forward, positions_from_mask, spec_for
from klrl.models.generate import generate_text
from klrl.models.gpt2 import GPT2, GPT2Config
from klrl.models.hf import CheckpointFormatError, load_score_head
from klrl.models.llama import Llama, LlamaConfig
from klrl.models.pretrained import from_pretrained, save_pretrained

__all__ = [
    "GPT2",
    "CausalLM",
    "CheckpointFormatError",
    "GPT2Config",
    "LMOutput",
    "Llama",
    "LlamaConfig",
    "causal_mask",
    "forward",
    "from_pretrained",
    "generate_text",
    "load_score_head",
    "positions_from_mask",
    "save_pretrained",
    "spec_for",
]

"""Model families behind one causal-LM interface (:mod:`klrl.models.base`), by name
(:mod:`klrl.models.registry`, :data:`klrl.registry.FAMILIES`): klrl's GPT ``"gpt"``, ``"gpt2"``,
``"llama"`` (Llama, Mistral, Qwen2, SmolLM2) and ``"gemma3"`` (Gemma 3 text models). Importing this
package imports every family's module, which registers it with its HF and GGUF readers.

Pretrained checkpoints: :func:`from_pretrained` (an HF directory or a GGUF file ->
``(model, params, tokenizer)``), :func:`save_pretrained` (an HF directory transformers loads),
:func:`generate_text`; failures raise :class:`CheckpointFormatError` (one line).
"""

from klrl.models import gemma3, gpt, gpt2, llama  # noqa: F401  (each registers its family)
from klrl.models.base import CausalLM, LMOutput, causal_mask, forward, positions_from_mask, spec_for
from klrl.models.gemma3 import Gemma3, Gemma3Config
from klrl.models.generate import generate_text
from klrl.models.gpt2 import GPT2, GPT2Config
from klrl.models.heads import ScalarHead, ValueHead
from klrl.models.hf import CheckpointFormatError, load_score_head
from klrl.models.llama import Llama, LlamaConfig
from klrl.models.pretrained import from_pretrained, save_pretrained
from klrl.models.registry import family_names, get_family, register_family

__all__ = [
    "GPT2",
    "Gemma3",
    "Gemma3Config",
    "CausalLM",
    "CheckpointFormatError",
    "GPT2Config",
    "LMOutput",
    "Llama",
    "LlamaConfig",
    "ScalarHead",
    "ValueHead",
    "causal_mask",
    "family_names",
    "forward",
    "from_pretrained",
    "generate_text",
    "get_family",
    "load_score_head",
    "positions_from_mask",
    "register_family",
    "save_pretrained",
    "spec_for",
]

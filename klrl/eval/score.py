"""Scores of completions: the exact KL to a reference, and an independent judge's likelihood and relevance.

* :func:`exact_kl`: ``sum_t sum_v pi(v | x, y<t) (log pi(v | x, y<t) - log pi_ref(v | x, y<t))`` per
  completion, nats per sequence, over the full vocabulary (:func:`klrl.algo.kl.full_kl`, each position
  floored at 0); its mean over completions sampled from ``pi`` at temperature 1 is the sequence KL
  ``KL(pi(.|x) || pi_ref(.|x))``.
* :class:`Judge`: another causal LM with its own tokenizer and its own prompt format, set apart from the
  policy's (``chat_template``: None = the judge's own chat template when its tokenizer has one, raw text
  otherwise: ``BOS prompt "\\n"``). Per completion ``y`` of prompt ``x`` (``y`` encoded alone, so the
  same tokens are scored in every context):

  - ``nll(y | x) = -sum_t log p_J(y_t | x, y<t)`` (:meth:`Judge.nll` with prompts),
  - ``nll(y) = -sum_t log p_J(y_t | BOS, y<t)`` (without prompts: the text alone),
  - the relevance, pointwise mutual information per token,
    ``pmi = (log p_J(y | x) - log p_J(y)) / |y| = (nll(y) - nll(y | x)) / |y|`` (:meth:`Judge.relevance`;
    Church & Hanks 1990; as a relevance score of a response, Li et al. 2016's MMI objective): how much
    the prompt makes the response more likely. An answer that would be given to any prompt scores near
    0; one that could only answer this prompt scores high.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from klrl.algo import kl as kl_lib
from klrl.algo.logprobs import token_logprobs
from klrl.config import DataConfig
from klrl.data.chat import PromptDataError
from klrl.data.prompts import PromptPool, build_pool
from klrl.eval.sample import chunks
from klrl.models.base import forward
from klrl.models.catalog import resolve_model_path
from klrl.models.pretrained import from_pretrained
from klrl.models.rollout import response_slice, sequence

RAW_SEP = "\n"  # a raw-text judge reads the prompt's text, this, then the response


class JudgeError(ValueError):
    """A judge that cannot be read or cannot score (one line)."""


@functools.partial(jax.jit, static_argnums=(0, 2))
def _exact_kl(model, params, ref_model, ref_params, prompt, pmask, response, mask):
    tokens, key_mask = sequence(prompt, pmask, response, mask)
    p, r = prompt.shape[1], response.shape[1]
    logits = _response_logits(model, params, tokens, key_mask, p, r)
    ref = _response_logits(ref_model, ref_params, tokens, key_mask, p, r)
    return kl_lib.seq_sum(kl_lib.full_kl(logits, ref, mask), mask)


def _response_logits(model, params, tokens, key_mask, p: int, r: int):
    """``[B, r, V]`` the logits that predict the response tokens; the LM head is applied to those positions
    only when the model has one apart (``head``), so the prompt's positions cost no vocabulary product."""
    if not hasattr(model, "head"):
        return response_slice(forward(model, params, tokens, key_mask).logits, p, r)
    hidden = forward(model, params, tokens, key_mask, logits=False).hidden
    return model.head(params, response_slice(hidden, p, r))


def exact_kl(
    model: Any, params: Any, ref: tuple[Any, Any], pool: PromptPool, idx, response, mask, batch: int
) -> np.ndarray:
    """``[M]`` the exact KL(pi || pi_ref) of each completion (row ``m`` answers prompt ``idx[m]`` of
    ``pool``), nats per sequence, >= 0 (module docstring); ``ref = (model, params)``."""
    out = np.zeros(len(idx), np.float32)
    for rows, k in chunks(len(idx), batch):
        p = idx[rows]
        arrays = (pool.tokens[p], pool.mask[p], response[rows], mask[rows])
        v = _exact_kl(model, params, ref[0], ref[1], *map(jnp.asarray, arrays))
        out[rows[:k]] = np.asarray(v)[:k]
    return out


@functools.partial(jax.jit, static_argnums=(0,))
def _nll(model, params, prompt, pmask, response, mask):
    tokens, key_mask = sequence(prompt, pmask, response, mask)
    logits = _response_logits(model, params, tokens, key_mask, prompt.shape[1], response.shape[1])
    return -jnp.sum(token_logprobs(logits, response) * mask, axis=-1)


def _text_of(prompt: Any) -> str:
    """A prompt's text for a raw-text judge (a conversation: its messages' contents, one a line)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return str(prompt)


def _ceil(n: int, m: int = 8) -> int:
    return max(m, -(-n // m) * m)


@dataclasses.dataclass
class Judge:
    """An independent causal LM (``model``, ``params``, ``tok``) and its prompt format (``chat_template``:
    its own template, or raw text); prompts longer than ``prompt_len`` judge tokens are cut (raw: keeping
    their end; templated: inside the user message, as PPO cuts them)."""

    path: str
    model: Any
    params: Any
    tok: Any
    chat_template: bool
    prompt_len: int = 128

    @classmethod
    def load(cls, path: str, chat_template: bool | None = None, prompt_len: int = 128) -> Judge:
        """Read ``path`` (an HF directory, a ``.gguf`` or a Hub name in the local cache); ``chat_template``
        None: the judge's own template when it has one, raw text otherwise."""
        try:
            model, params, tok = from_pretrained(resolve_model_path(path, "--judge"))
        except (OSError, ValueError) as e:  # ConfigError, CheckpointFormatError are ValueErrors
            raise JudgeError(f"--judge: {e}") from None
        if tok is None:
            raise JudgeError(f"--judge: {path}: no tokenizer")
        has = getattr(tok, "chat_template", None) is not None
        if chat_template and not has:
            raise JudgeError(f"--judge.chat_template true: {path}: its tokenizer has no chat template")
        if tok.bos_id is None and not (has if chat_template is None else chat_template):
            raise JudgeError(f"--judge: {path}: no BOS token, so a raw-text judge has no start to read from")
        return cls(
            str(path), model, params, tok, has if chat_template is None else bool(chat_template), prompt_len
        )

    @property
    def format(self) -> str:
        return "its chat template" if self.chat_template else "raw text (BOS, prompt, newline)"

    def prompt_pool(self, prompts: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [N, P], mask [N, P])``: the prompts in the judge's format, left-padded to the longest
        (rounded up to 8)."""
        if self.chat_template:
            data = DataConfig(chat_template=True, prompt_len=self.prompt_len, field="prompt")
            try:
                pool = build_pool([{"prompt": p} for p in prompts], self.tok, data, source="judge prompts")
            except PromptDataError as e:
                raise JudgeError(f"--judge: {e}") from None
            tok, mask = pool.tokens, pool.mask
        else:
            rows = [
                [self.tok.bos_id, *self.tok.encode(_text_of(p) + RAW_SEP)][-self.prompt_len :]
                for p in prompts
            ]
            width = max(map(len, rows))
            tok = np.full((len(rows), width), self.tok.pad_id, np.int32)
            mask = np.zeros((len(rows), width), np.float32)
            for i, r in enumerate(rows):
                tok[i, width - len(r) :], mask[i, width - len(r) :] = r, 1.0
        width = _ceil(int(mask.sum(1).max()))
        if width < tok.shape[1]:
            tok, mask = tok[:, -width:], mask[:, -width:]
        elif width > tok.shape[1]:
            pad = width - tok.shape[1]
            tok = np.pad(tok, ((0, 0), (pad, 0)), constant_values=self.tok.pad_id)
            mask = np.pad(mask, ((0, 0), (pad, 0)))
        return tok, mask

    def responses(self, texts: list[str], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [M, R], mask [M, R])``: each text encoded alone by the judge's tokenizer (cut at
        ``max_tokens``), right-padded to a multiple of 8."""
        ids = [self.tok.encode(t)[:max_tokens] for t in texts]
        r = _ceil(max(1, max(map(len, ids), default=1)))
        resp, mask = np.full((len(ids), r), self.tok.pad_id, np.int32), np.zeros((len(ids), r), np.float32)
        for i, x in enumerate(ids):
            resp[i, : len(x)], mask[i, : len(x)] = x, 1.0
        return resp, mask

    def nll(
        self, texts: list[str], prompts: list[Any] | None = None, idx: Any = None, batch: int = 16,
        max_tokens: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """``(nll [M], tokens [M])``: each text's negative log-likelihood summed over its judge tokens,
        after prompt ``prompts[idx[m]]`` in the judge's format (``idx`` None: ``prompts[m]``), or after the
        judge's BOS alone when ``prompts`` is None; and its token count (an empty text: 0 and 0)."""
        resp, rmask = self.responses(texts, max_tokens)
        if prompts is None:
            ptok = np.full((1, 1), self.tok.bos_id, np.int32)
            pmask, idx = np.ones((1, 1), np.float32), np.zeros(len(texts), int)
        else:
            ptok, pmask = self.prompt_pool(prompts)
            idx = np.arange(len(texts)) if idx is None else np.asarray(idx)
        out = np.zeros(len(texts), np.float64)
        for rows, k in chunks(len(texts), batch):
            v = _nll(self.model, self.params, jnp.asarray(ptok[idx[rows]]), jnp.asarray(pmask[idx[rows]]),
                     jnp.asarray(resp[rows]), jnp.asarray(rmask[rows]))  # fmt: skip
            out[rows[:k]] = np.asarray(v, np.float64)[:k]
        return out, rmask.sum(axis=1)

    def relevance(
        self,
        texts: list[str],
        prompts: list[Any],
        idx: Any = None,
        batch: int = 16,
        max_tokens: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Per text: ``nll_cond`` (given its prompt), ``nll_text`` (alone), ``tokens``, and ``pmi`` =
        ``(nll_text - nll_cond) / tokens`` nats per token (NaN for an empty text); module docstring."""
        cond, n = self.nll(texts, prompts, idx, batch, max_tokens)
        alone, _ = self.nll(texts, None, None, batch, max_tokens)
        with np.errstate(invalid="ignore", divide="ignore"):
            pmi = np.where(n > 0, (alone - cond) / np.maximum(n, 1), np.nan)
        return {"nll_cond": cond, "nll_text": alone, "tokens": n, "pmi": pmi}

"""Bradley-Terry reward-model training: any causal-LM trunk plus a scalar score head (klrl reward-model).

The reward of a sequence is ``r = w . h_last``: the trunk's final hidden state at the last real token,
times a bias-free score vector ``w [D]`` (a ``*ForSequenceClassification`` model's ``score`` with one
label). On preference pairs the loss is (Ouyang et al. 2022, "InstructGPT", eq. 1; TRL's
``RewardTrainer.compute_loss``)::

    L = mean_i -log sigmoid(r(x_i, y_chosen) - r(x_i, y_rejected))
        + center_coef * mean_i (r_chosen + r_rejected)^2          (TRL's center_rewards_coefficient)

and the accuracy the fraction of pairs with ``r_chosen > r_rejected`` (TRL's ``compute_accuracy``;
ties count as wrong). The trunk is trained in full or through LoRA adapters
(:class:`klrl.models.lora.LoRA`; the base frozen), with optax AdamW; one epoch is one jitted
``lax.scan`` over shuffled minibatches (the last partial minibatch is left out of that epoch).

:func:`save_reward_model` writes the result as an HF sequence-classification directory (the adapters
merged into the trunk: :func:`klrl.models.lora.merged_kernels`) that ``--model.reward_path`` and
``transformers.AutoModelForSequenceClassification`` load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from klrl.models import lora as lora_lib
from klrl.models.base import forward
from klrl.models.hf import SAFETENSORS, save_safetensors
from klrl.rewards.pairs import Pairs

Array = jax.Array


# ---- the maths -------------------------------------------------------------------------------------
def bt_loss(r_chosen: Array, r_rejected: Array, center_coef: float = 0.0) -> Array:
    """``mean(-log sigmoid(r_c - r_r)) + center_coef * mean((r_c + r_r)^2)`` (module docstring)."""
    loss = -jnp.mean(jax.nn.log_sigmoid(r_chosen - r_rejected))
    return loss + center_coef * jnp.mean((r_chosen + r_rejected) ** 2)


def accuracy(r_chosen: Array, r_rejected: Array) -> Array:
    """The fraction of pairs with ``r_chosen > r_rejected`` (a tie is wrong)."""
    return jnp.mean((r_chosen > r_rejected).astype(jnp.float32))


MIN_HELDOUT = 50  # fewer held-out pairs than this: the accuracy is reported with a warning


def wilson_interval(accuracy: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``accuracy`` over ``n`` trials (Wilson 1927;
    Brown, Cai & DasGupta 2001): ``(p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)``; unlike
    ``p +- z sqrt(p(1-p)/n)`` it is not empty at ``p`` = 0 or 1. ``(0, 1)`` for ``n`` = 0."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = float(accuracy), z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * float(np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)))
    return max(0.0, centre - half), min(1.0, centre + half)


def heldout_warning(accuracy: float, n: int) -> str | None:
    """One line when a held-out accuracy rests on fewer than :data:`MIN_HELDOUT` pairs (its 95% Wilson
    interval, :func:`wilson_interval`); None otherwise."""
    if n >= MIN_HELDOUT:
        return None
    lo, hi = wilson_interval(accuracy, n)
    return (
        f"warning: the held-out accuracy {accuracy:.3f} rests on {n} pair{'s' if n != 1 else ''} (fewer than "
        f"{MIN_HELDOUT}): its 95% interval is [{lo:.2f}, {hi:.2f}] (Wilson); more pairs or a larger "
        "--rm.eval_fraction narrow it"
    )


def last_token(hidden: Array, mask: Array) -> Array:
    """``hidden [B, T, D]`` at each row's last real token (right-padded ``mask [B, T]``) -> ``[B, D]``."""
    n = jnp.sum(mask, axis=-1).astype(jnp.int32)
    idx = jnp.maximum(n - 1, 0)
    return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]


def scores(model: Any, trunk: Any, score: Array, tokens: Array, mask: Array) -> Array:
    """``r = score . h_last`` ``[B]`` float32 of right-padded ``tokens [B, T]`` (``score [D]``)."""
    hidden = forward(model, trunk, tokens, mask, logits=False).hidden
    return last_token(hidden.astype(jnp.float32), mask) @ score.astype(jnp.float32)


# ---- training --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The optimiser and the passes over the pairs (TRL's defaults where it has one: AdamW,
    ``center_rewards_coefficient=None``)."""

    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 8
    weight_decay: float = 0.0
    center_coef: float = 0.0
    seed: int = 0


class Trainable:
    """The trained parameters of a trunk (``lora``: its adapters, the base frozen; ``head_only``: none,
    the whole trunk frozen, a linear probe of its last hidden state) and a score head."""

    def __init__(self, model: Any, base: Any, lora: lora_lib.LoRA | None = None, head_only: bool = False):
        if head_only and lora is not None:
            raise ValueError("a head-only reward model has no adapters (lora.rank must be 0)")
        self.model, self.base, self.lora, self.head_only = model, base, lora, head_only

    @property
    def frozen(self) -> bool:
        """The base is an argument of the compiled functions (not trained)."""
        return self.lora is not None or self.head_only

    def init(self, key: Array) -> dict:
        """``{'trunk': the full trunk or the adapters, 'score': [D]}``: ``score ~ N(0, 1/D)`` (a
        fresh head; transformers draws it from ``N(0, initializer_range^2)``)."""
        k_head, k_lora = jax.random.split(key)
        d = self.model.hidden_size
        if self.head_only:
            trunk = {}
        elif self.lora is None:
            trunk = self.base
        else:  # jitted: qwix's eager init forward is slower than its compile
            trunk = jax.jit(self.lora.init_adapters)(self.base, k_lora)
        return {"trunk": trunk, "score": jax.random.normal(k_head, (d,), jnp.float32) / np.sqrt(d)}

    def apply_model(self) -> Any:
        return self.model if self.lora is None else self.lora

    def trunk(self, params: dict, base: Any) -> Any:
        """The trunk parameters a forward takes (the adapters beside the frozen ``base``)."""
        if self.head_only:
            return base
        return params["trunk"] if self.lora is None else lora_lib.merge(base, params["trunk"])

    def merged(self, params: dict) -> Any:
        """The trunk as plain parameters of the family (adapters folded in)."""
        if self.head_only:
            return self.base
        if self.lora is None:
            return params["trunk"]
        return lora_lib.merged_kernels(self.base, params["trunk"], self.lora.scale)


@functools.partial(jax.jit, static_argnums=0)
def _last_hidden(model: Any, trunk: Any, tokens: Array, mask: Array) -> Array:
    return last_token(forward(model, trunk, tokens, mask, logits=False).hidden.astype(jnp.float32), mask)


def last_hidden(model: Any, trunk: Any, tokens: Any, mask: Any, chunk: int = 64) -> Array:
    """``[N, D]`` float32: the trunk's last hidden state at each right-padded row's last real token, ``chunk``
    rows at a time by one jitted forward (the last chunk filled up with repeated rows, dropped)."""
    # the trunk is an argument (a closed-over array would be a constant of the compiled program); the model is
    # static, so every call with an equal model and chunk shape reuses one compiled forward
    fn = functools.partial(_last_hidden, model)
    n = int(tokens.shape[0])
    c = min(chunk, n)
    rows = np.arange(-(-n // c) * c) % n
    parts = [
        fn(trunk, jnp.asarray(tokens[rows[i : i + c]]), jnp.asarray(mask[rows[i : i + c]]))
        for i in range(0, len(rows), c)
    ]
    return jnp.concatenate(parts)[:n]


def _pair_scores(t: Trainable, params: dict, base: Any, batch: tuple) -> tuple[Array, Array]:
    if t.head_only:  # the batch: the frozen trunk's last hidden states of chosen and rejected (last_hidden)
        hc, hr = batch
        return hc @ params["score"], hr @ params["score"]
    ct, cm, rt, rm = batch
    r = scores(t.apply_model(), t.trunk(params, base), params["score"], jnp.concatenate([ct, rt]),
               jnp.concatenate([cm, rm]))  # fmt: skip
    return r[: ct.shape[0]], r[ct.shape[0] :]


def make_epoch(t: Trainable, opt: optax.GradientTransformation, s: TrainSettings) -> Callable:
    """``epoch(params, opt_state, base, data, key) -> (params, opt_state, mean loss, mean accuracy)``:
    one jitted ``lax.scan`` of AdamW steps over a ``key``-shuffled pass of ``data`` (a :class:`Pairs`'
    four arrays)."""

    def loss_fn(params, base, batch):
        rc, rr = _pair_scores(t, params, base, batch)
        return bt_loss(rc, rr, s.center_coef), accuracy(rc, rr)

    @jax.jit
    def epoch(params, opt_state, base, data, key):
        n = data[0].shape[0]
        bs = min(s.batch_size, n)
        perm = jax.random.permutation(key, n)[: (n // bs) * bs].reshape(n // bs, bs)

        def step(carry, idx):
            params, opt_state = carry
            batch = tuple(x[idx] for x in data)
            (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, base, batch)
            upd, opt_state = opt.update(g, opt_state, params)
            return (optax.apply_updates(params, upd), opt_state), (loss, acc)

        (params, opt_state), (losses, accs) = jax.lax.scan(step, (params, opt_state), perm)
        return params, opt_state, losses.mean(), accs.mean()

    return epoch


def make_evaluate(t: Trainable, center_coef: float = 0.0, chunk: int = 64) -> Callable:
    """``evaluate(params, base, data) -> {'loss', 'accuracy'}`` on all of ``data``, scored ``chunk`` pairs
    at a time by one jitted function (the last chunk filled up with repeated rows, their scores dropped)."""
    pair_scores = jax.jit(lambda params, base, batch: _pair_scores(t, params, base, batch))

    def evaluate(params, base, data) -> dict:
        n = int(data[0].shape[0])
        c = min(chunk, n)
        rows = np.arange(-(-n // c) * c) % n
        parts = [
            pair_scores(params, base, tuple(x[rows[i : i + c]] for x in data)) for i in range(0, len(rows), c)
        ]
        rc, rr = (jnp.concatenate([p[k] for p in parts])[:n] for k in (0, 1))
        return {"loss": float(bt_loss(rc, rr, center_coef)), "accuracy": float(accuracy(rc, rr))}

    return evaluate


def train(
    model: Any,
    base: Any,
    train_pairs: Pairs,
    eval_pairs: Pairs,
    s: TrainSettings,
    lora: lora_lib.LoRA | None = None,
    log: Callable[[str], None] | None = None,
    head_only: bool = False,
) -> tuple[Any, np.ndarray, list[dict]]:
    """Train a reward model; returns ``(trunk parameters (adapters merged), score [D], history)``,
    ``history`` one dict per epoch (``loss``/``accuracy`` on the training minibatches, ``eval_loss``/
    ``eval_accuracy`` on ``eval_pairs`` after the epoch). ``log`` gets one line per epoch.
    ``head_only``: the trunk stays ``base`` and only the score head is trained (a linear probe), on the
    trunk's last hidden states computed once (:func:`last_hidden`)."""
    t = Trainable(model, base, lora, head_only)
    data = tuple(jnp.asarray(x) for x in train_pairs[:4])
    held = tuple(jnp.asarray(x) for x in eval_pairs[:4])
    if head_only:  # the trunk is frozen: its features once, then epochs of a linear model on them
        data, held = (tuple(last_hidden(model, base, d[i], d[i + 1]) for i in (0, 2)) for d in (data, held))
    params, history = _fit(t, data, held, s, log, len(eval_pairs))
    return t.merged(params), np.asarray(params["score"], np.float32), history


def train_head(
    model: Any,
    train_feats: tuple[Any, Any],
    eval_feats: tuple[Any, Any],
    s: TrainSettings,
    log: Callable[[str], None] | None = None,
) -> tuple[np.ndarray, list[dict]]:
    """The head-only reward model (a linear probe) on features already computed: ``(chosen, rejected)``
    ``[N, D]`` last hidden states (:func:`last_hidden`), so a study whose pairs share responses computes
    each response's features once. The same training as ``train(..., head_only=True)``; returns
    ``(score [D], history)``."""
    t = Trainable(model, None, None, head_only=True)
    data = tuple(jnp.asarray(x, jnp.float32) for x in train_feats)
    held = tuple(jnp.asarray(x, jnp.float32) for x in eval_feats)
    params, history = _fit(t, data, held, s, log, int(held[0].shape[0]))
    return np.asarray(params["score"], np.float32), history


def _fit(
    t: Trainable, data: tuple, held: tuple, s: TrainSettings, log: Any, n_eval: int
) -> tuple[dict, list]:
    """``s.epochs`` epochs of AdamW on ``data`` (a :class:`Pairs`' arrays, or features with ``head_only``),
    evaluated on ``held`` after each; ``(params, history)``."""
    k_init, k_perm = jax.random.split(jax.random.key(s.seed))
    params = t.init(k_init)
    frozen = t.base if t.frozen else None  # full fine-tuning: the trunk is in params, nothing frozen
    opt = optax.adamw(s.lr, weight_decay=s.weight_decay)
    opt_state = opt.init(params)
    epoch, evaluate = make_epoch(t, opt, s), make_evaluate(t, s.center_coef)
    history = []
    for e, k in enumerate(jax.random.split(k_perm, s.epochs)):
        params, opt_state, loss, acc = epoch(params, opt_state, frozen, data, k)
        ev = evaluate(params, frozen, held)
        row = {"epoch": e + 1, "loss": float(loss), "accuracy": float(acc),
               "eval_loss": ev["loss"], "eval_accuracy": ev["accuracy"]}  # fmt: skip
        history.append(row)
        if log:
            log(
                f"epoch {e + 1}/{s.epochs}: train loss {row['loss']:.4f} (accuracy {row['accuracy']:.3f}), "
                f"held-out loss {row['eval_loss']:.4f} accuracy {row['eval_accuracy']:.3f} "
                f"({n_eval} pairs)"
            )
    return params, history


# ---- the HF sequence-classification directory -------------------------------------------------------
def seq_cls_architecture(causal: str) -> str:
    """``LlamaForCausalLM`` -> ``LlamaForSequenceClassification``; ``GPT2LMHeadModel`` ->
    ``GPT2ForSequenceClassification`` (transformers' class names)."""
    for suffix in ("ForCausalLM", "LMHeadModel"):
        if causal.endswith(suffix):
            return causal[: -len(suffix)] + "ForSequenceClassification"
    raise ValueError(f"{causal}: not a causal-LM architecture name")


def pad_for_scoring(tokenizer: Any) -> int:
    """The pad id of the written directory: the tokenizer's, unless it is a stop id (SmolLM2 pads with
    its end token ``<|im_end|>``): transformers' sequence classifiers read the last token that is not
    ``pad_token_id``, which would then skip the end token klrl reads (and the model was trained on).
    Then the BOS token, or else the first added token, that is no stop id (it is never a sequence's
    last token); the tokenizer's own pad id if there is none."""
    stops = set(getattr(tokenizer, "stop_ids", ()) or ())
    if tokenizer.pad_id not in stops:
        return int(tokenizer.pad_id)
    added = sorted(tokenizer.tok.get_added_tokens_decoder()) if hasattr(tokenizer, "tok") else []
    for i in [tokenizer.bos_id, *added]:
        if i is not None and i not in stops:
            return int(i)
    return int(tokenizer.pad_id)


def _save_tokenizer(tokenizer: Any, pad: int, out: Path) -> None:
    tokenizer.save(out)
    if pad != tokenizer.pad_id:  # tokenizer_config.json's pad_token: the one config.json names
        f = out / "tokenizer_config.json"
        doc = json.loads(f.read_text())
        doc["pad_token"] = tokenizer.decode([pad], skip_special_tokens=False)
        f.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def save_reward_model(model: Any, trunk: Any, score: np.ndarray, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write an HF ``*ForSequenceClassification`` directory: ``config.json`` (the family's, with its
    architecture renamed, one label, ``pad_token_id`` :func:`pad_for_scoring`), ``model.safetensors``
    (the trunk's tensors without ``lm_head.weight``, plus ``score.weight [1, D]``, float32) and the
    tokenizer files (their ``pad_token`` the same). :func:`klrl.models.hf.load_hf` (``score=True``) and
    transformers read it back, and transformers scores right-padded sequences as klrl does."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in model.params_to_hf(trunk).items()}
    tensors.pop("lm_head.weight", None)
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(score, np.float32).reshape(1, -1))
    save_safetensors(tensors, out / SAFETENSORS, {"format": "pt"})
    cfg = dict(model.hf_config())
    cfg["architectures"] = [seq_cls_architecture(a) for a in cfg.get("architectures", [])]
    cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if tokenizer is not None:
        cfg["pad_token_id"] = pad_for_scoring(tokenizer)
        _save_tokenizer(tokenizer, cfg["pad_token_id"], out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out

"""What ``make_train`` fixes and every stage reads: the models of a run (:func:`build_models`), the frozen
:class:`Context` (the config, the task, the models, the controller, the optimiser and the static shapes
and modes derived from them), the iteration's coefficients and the initial train state on a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from klrl.algo.advantages import needs_critic
from klrl.algo.control import Controller
from klrl.config import RunConfig
from klrl.models import lora as lora_lib
from klrl.models.base import CausalLM
from klrl.models.heads import ValueHead, attach
from klrl.models.registry import get_family
from klrl.models.remat import with_remat
from klrl.registry import ESTIMATORS
from klrl.step.chunked import use_chunks
from klrl.step.parallel import SWEEP, param_specs
from klrl.step.stages import TrainState
from klrl.tasks.base import Task

Array = jax.Array


class Models(NamedTuple):
    """The networks of a run. ``value_head`` sits on the policy trunk (``model.value_model=head``)
    or on ``value`` (``separate``, or ``lora``: the base with the critic's adapters); both are None
    without a critic. ``ref`` is the reference's model: the base family (adapters off; weight-only
    quantised with ``model.ref_quant``), None = ``policy``."""

    policy: CausalLM
    value: CausalLM | None
    value_head: ValueHead | None
    ref: CausalLM | None = None


def adapted(cfg: RunConfig, base: CausalLM, rank: int) -> CausalLM:
    """``base`` with rank-``rank`` adapters of ``cfg.lora`` (on the ``model.ref_quant`` base)."""
    lo = cfg.lora
    return lora_lib.LoRA(base, rank, lo.alpha, lo.targets, quant=cfg.model.ref_quant)


def build_models(cfg: RunConfig, policy: CausalLM, family: str = "gpt") -> Models:
    """The one factory: the policy (with ``lora.rank`` adapters on the base ``policy``), the value trunk
    (a ``family`` model of ``cfg.model`` without LM head, as long as the policy; or the base with its own
    adapters) and the value head, as ``cfg.ppo.advantage`` and ``cfg.model.value_model`` ask."""
    base = ref = policy.base if isinstance(policy, lora_lib.LoRA) else policy
    if cfg.lora.rank > 0 and not isinstance(policy, lora_lib.LoRA):
        policy = adapted(cfg, base, cfg.lora.rank)
    if not needs_critic(cfg.ppo.advantage):
        return Models(policy, None, None, ref)
    if cfg.model.value_model == "head":
        return Models(policy, None, ValueHead(policy.hidden_size), ref)
    if cfg.model.value_model == "lora":
        value = adapted(cfg, base, cfg.lora.critic_rank or cfg.lora.rank)
    else:
        value = get_family(family)(cfg.model, policy.vocab_size, policy.max_len, lm_head=False)
    return Models(policy, value, ValueHead(value.hidden_size), ref)


def full_params(ctx: Context, params: Any, base: Any) -> Any:
    """The train state's ``params`` as the models apply them: with adapters (``lora.rank``,
    ``model.value_model=lora``) each is merged with the frozen ``base`` (:func:`klrl.models.lora.merge`:
    a dict union, no copy); otherwise ``params`` itself."""
    if not (ctx.lora or ctx.lora_critic):
        return params
    out = dict(params)
    if ctx.lora:
        out["policy"] = lora_lib.merge(base, params["policy"])
    if ctx.lora_critic:
        out["value"] = lora_lib.merge(base, params["value"])
    return out


@dataclass(frozen=True)
class Context:
    """What ``make_train`` fixed; every stage is a function of it."""

    cfg: RunConfig
    task: Task
    models: Models
    policy_params: Any  # the initial policy = the reference
    value_params: Any  # initial separate value model (trunk + head), or None: a fresh one
    stop_ids: tuple[int, ...]
    controller: Controller
    optimizer: optax.GradientTransformation
    n_dev: int
    log_target: bool = False  # log ``ctrl/target``: some run of this program has an adaptive controller
    samples: int = 0  # rows returned as ``_samples/*`` outputs for the host to decode (klrl.loop.samples)
    ref_init: Any = None  # the reference's own initial parameters (quantised, model.ref_quant), else None
    policy_adapters: Any = None  # the policy's initial adapters (model.adapter), None: fresh (B = 0)
    fold_rollout: bool = True  # LoRA: sample from W + s A B (off in a sweep: one merged base per member)

    @property
    def lora(self) -> bool:
        """The policy is adapters on the frozen base (``lora.rank`` > 0); the base is ``ref_params``."""
        return isinstance(self.models.policy, lora_lib.LoRA)

    @property
    def lora_critic(self) -> bool:
        """The critic is the frozen base with its own adapters (``model.value_model=lora``)."""
        return isinstance(self.models.value, lora_lib.LoRA)

    @property
    def ref_model(self) -> CausalLM:
        """The reference's model (the base family; quantised with ``model.ref_quant``)."""
        return self.models.ref if self.models.ref is not None else self.models.policy

    # shapes and modes, all static
    @property
    def b_glob(self) -> int:
        return self.cfg.train.batch_size

    @property
    def b_loc(self) -> int:
        return self.b_glob // self.n_dev

    @property
    def mb_glob(self) -> int:
        return self.b_glob // self.cfg.ppo.minibatches

    @property
    def p_len(self) -> int:
        return self.task.prompt_len

    @property
    def r_len(self) -> int:
        return self.cfg.sampling.response_len

    @property
    def critic(self) -> bool:
        return self.models.value_head is not None

    @property
    def head(self) -> bool:
        return self.critic and self.models.value is None

    @property
    def separate(self) -> bool:
        return self.models.value is not None

    @property
    def kl_in_loss(self) -> bool:
        return self.cfg.kl.placement in ("loss", "reward+loss")

    @property
    def drives_reward(self) -> bool:
        return self.cfg.ctrl.drives == "reward"

    # the logits' path (klrl.step.chunked) and rematerialisation (klrl.models.remat)
    @property
    def chunked(self) -> bool:
        """Logit-derived terms from hidden states in chunks (``model.logits``; auto: V >= 32768)."""
        return use_chunks(self.cfg.model.logits, self.models.policy.vocab_size)

    @property
    def full_estimators(self) -> bool:
        """Some KL estimator that is used reads the full logits (``full``)."""
        kl, c = self.cfg.kl, self.cfg.ctrl
        names = [kl.estimator, c.estimator] + ([kl.loss_estimator] if self.kl_in_loss else [])
        return any(ESTIMATORS.meta(n)["inputs"] == "logits" for n in names)

    @property
    def full_in_loss(self) -> bool:
        """The KL term of the loss reads the full logits (a ``full`` ``kl.loss_estimator``)."""
        return self.kl_in_loss and ESTIMATORS.meta(self.cfg.kl.loss_estimator)["inputs"] == "logits"

    @property
    def exact_kl(self) -> bool:
        """The exact full-vocabulary KL is computed (for the metric or an estimator)."""
        return self.cfg.kl.exact_metric or self.full_estimators

    @property
    def keep_logits(self) -> bool:
        """The rollout keeps its ``[B, R, V]`` tempered logits (the full path's exact KL)."""
        return self.exact_kl and not self.chunked

    @property
    def keep_hidden(self) -> bool:
        """The rollout keeps its ``[B, R, D]`` hidden states (the chunked path's exact KL)."""
        return self.exact_kl and self.chunked

    @property
    def update_policy(self) -> CausalLM:
        """The policy as the update differentiates it (``model.remat``)."""
        return with_remat(self.models.policy, self.cfg.model.remat)

    @property
    def update_value(self) -> CausalLM | None:
        """The separate value trunk as the update differentiates it (``model.remat``)."""
        return None if self.models.value is None else with_remat(self.models.value, self.cfg.model.remat)

    @property
    def ref_dtype(self) -> Any:
        """The reference's storage dtype of floating leaves (``model.ref_dtype``)."""
        return jnp.bfloat16 if self.cfg.model.ref_dtype == "bfloat16" else jnp.float32

    @property
    def ref_frozen(self) -> bool:
        """The reference never changes (``kl.ref_update_every`` 0): the step passes it through."""
        return self.cfg.kl.ref_update_every <= 0

    @property
    def reward_on_reference(self) -> bool:
        """The task's reward model reads the frozen reference's trunk, so the scoring takes the reward
        from the reference's forward (``JaxReward.from_hidden``) instead of running its trunk again:
        its ``trunk`` is the policy model and the very arrays of ``policy_params`` (the reference's
        initial parameters), the reference stays frozen (``kl.ref_update_every`` 0) and is stored in
        those arrays' dtype (``model.ref_dtype``). The same numbers, one trunk forward less. (The reward
        then reads the state's reference: a ``state.ref_params`` replaced by hand moves it too.)"""
        r = self.task.reward
        trunk = getattr(r, "trunk", None)
        if getattr(r, "from_hidden", None) is None or trunk is None or not self.ref_frozen:
            return False
        if self.ref_init is not None:  # a quantised reference: not the reward's float trunk
            return False
        model, params = trunk
        if model is not self.ref_model and model != self.ref_model:
            return False
        mine, theirs = jax.tree.leaves(params), jax.tree.leaves(self.policy_params)
        if jax.tree.structure(params) != jax.tree.structure(self.policy_params):
            return False
        floating = [x for x in theirs if jnp.issubdtype(x.dtype, jnp.floating)]
        return all(a is b for a, b in zip(mine, theirs, strict=True)) and all(
            x.dtype == self.ref_dtype for x in floating
        )


def coefs(ctx: Context, state: TrainState) -> tuple[Array, Array]:
    """(reward-side beta, loss-side coefficient)."""
    if ctx.drives_reward:
        return state.ctrl.beta, state.other_coef
    return state.other_coef, state.ctrl.beta


# ---- init -------------------------------------------------------------------------------------------


def as_ref_dtype(ctx: Context, tree: Any) -> Any:
    """``tree``'s floating leaves in the reference's storage dtype (``model.ref_dtype``). A refreshed
    reference gets new buffers (the step donates it); a frozen one (``kl.ref_update_every`` 0) keeps
    the arrays already in that dtype: the step neither donates nor returns it
    (:func:`klrl.step.parallel.shard_step`'s ``kept``), so the reference and the task's loaded parameters
    are one copy in memory."""
    dt = ctx.ref_dtype
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    same = jnp.asarray if ctx.ref_frozen else jnp.copy
    return jax.tree.map(lambda x: x.astype(dt) if floating(x) and x.dtype != dt else same(x), tree)


def initial_state(ctx: Context, seed: int | Array = 0, beta: float | Array | None = None) -> TrainState:
    """The train state of ``seed``: policy = a copy of the reference (plus a fresh value head),
    a fresh separate value model, the optimiser and the controller at ``beta`` (default ``kl.beta``)."""
    # raw uint32 keys: plain arrays that checkpoint, vmap and compare like any other leaf
    key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    k_head, k_value, k_run = jax.random.split(key, 3)
    m, kl_cfg = ctx.models, ctx.cfg.kl
    ref = ctx.ref_init if ctx.ref_init is not None else as_ref_dtype(ctx, ctx.policy_params)
    if ctx.lora:  # adapters on the frozen base (B = 0: the initial policy is the base)
        pol = ctx.policy_adapters
        if pol is None:
            pol = m.policy.init_adapters(ref, jax.random.fold_in(k_head, 1))
        pol = jax.tree.map(jnp.copy, pol)
    else:
        pol = jax.tree.map(jnp.copy, ctx.policy_params)  # own buffers: the step donates the state
    if ctx.head:  # graft a fresh value head onto the pretrained trunk
        pol = attach(pol, m.value_head.init(k_head))
    value = None
    if ctx.lora_critic:  # the critic's own adapters on the same base, and a fresh value head
        value = attach(m.value.init_adapters(ref, jax.random.fold_in(k_value, 1)), m.value_head.init(k_value))
    elif ctx.separate:
        value = ctx.value_params
        if value is None:
            value = attach(m.value.init(k_value), m.value_head.init(k_value))
        value = jax.tree.map(jnp.copy, value)
    params = {"policy": pol, "value": value}
    b_r = kl_cfg.beta if beta is None else beta
    driven, other = (b_r, kl_cfg.loss_coef) if ctx.drives_reward else (kl_cfg.loss_coef, b_r)
    return TrainState(
        params=params,
        ref_params=ref,
        opt_state=ctx.optimizer.init(params),
        ctrl=jax.tree.map(jnp.copy, ctx.controller.init(jnp.asarray(driven, jnp.float32))),  # own buffers
        other_coef=jnp.asarray(other, jnp.float32),
        rng=k_run,
        iteration=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
    )


def state_shardings(ctx: Context, mesh: Any, sweep: bool = False) -> Any:
    """The :class:`NamedSharding` pytree of the train state on ``mesh``: parameters, reference,
    optimiser moments and the separate value model placed on ``fsdp``/``tensor`` by the families'
    :meth:`~klrl.models.base.CausalLM.partition_rules` (first match on the leaf's path; policy
    rules, then the value model's), fitted to the mesh (:func:`klrl.step.parallel.fit_spec`: a
    dimension an axis does not divide stays replicated); everything else replicated. With
    ``sweep`` every leaf has the members' leading axis on ``'sweep'``. On a mesh with
    ``fsdp = tensor = 1`` every leaf is replicated (or split over ``sweep``) as before."""
    rules = tuple(ctx.models.policy.partition_rules())
    if ctx.models.value is not None:
        rules += tuple(ctx.models.value.partition_rules())
    # the models' parameters as arguments: they may be abstract (jax.ShapeDtypeStruct)
    abstract = jax.eval_shape(
        lambda p, v: initial_state(replace(ctx, policy_params=p, value_params=v), 0),
        ctx.policy_params,
        ctx.value_params,
    )
    specs = param_specs(rules, abstract, mesh)
    if sweep:
        stack = lambda t: jax.tree.map(lambda s: PartitionSpec(SWEEP, *s), t)
        # a frozen reference (the shared base) is one copy for every member: no leading axis
        ref = specs.ref_params if ctx.ref_frozen else stack(specs.ref_params)
        specs = stack(specs._replace(ref_params=None))._replace(ref_params=ref)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def init_state(
    ctx: Context, mesh: Any, seed: int | Array = 0, beta: float | Array | None = None
) -> TrainState:
    """:func:`initial_state` placed on ``mesh`` as ``step`` takes and returns it
    (:func:`state_shardings`): otherwise the second call recompiles."""
    return jax.device_put(initial_state(ctx, seed, beta), state_shardings(ctx, mesh))

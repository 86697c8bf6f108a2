"""``klrl dpo``: direct preference optimisation (DPO, IPO, robust, hinge) from preference pairs.

::

    klrl dpo --model.path BASE --pairs FILE --out DIR [--config PPO_CONFIG]
        [--dpo.loss sigmoid|ipo|robust|hinge] [--dpo.beta B | --dpo.betas B1,B2,..] [--dpo.seeds S1,..]
        [--dpo.label_smoothing E] [--dpo.lr X] [--dpo.batch_size N] [--dpo.minibatches M]
        [--dpo.iterations N] [--dpo.eval_fraction F] [--dpo.eval_every N] [--dpo.eval_prompts N]
        [--dpo.checkpoint_every N] [--data.chat_template B] [--data.prompt_len P]
        [--sampling.response_len R] [--sampling.use_eos B] [--lora.rank R --lora.alpha A --lora.targets RE]
    klrl dpo --resume DIR --pairs FILE [--dpo.iterations N]

``FILE`` holds TRL's ``prompt``/``chosen``/``rejected`` rows (the format of ``klrl reward-model``),
tokenised in PPO's text format (``--config``'s or PPO's default ``data``/``sampling`` fields, the flags
over them). Every ``(beta, seed)`` of ``--dpo.betas x --dpo.seeds`` is a member of one compiled program.
``DIR`` gets the run directory of :mod:`klrl.loop.dpo` (metrics, checkpoints, each member's ``policy/``).
``--resume DIR`` continues it from its latest checkpoint with its ``config.json`` (only
``--dpo.iterations`` may change; the pairs file must be the same). Bad input is one line, exit
status 2: a field's error names the field, as :func:`klrl.dpo` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from klrl.cli.args import fail, load_config_file
from klrl.cli.flags import PPO_FIELDS, dpo_parser
from klrl.config import ConfigError, DataConfig, LoRAConfig, SamplingConfig
from klrl.config.dpo import DPOConfig
from klrl.io.paths import dpo_config_file


def _floats(text: str | None, flag: str, kind: type) -> list | None:
    if text is None:
        return None
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{flag}: expected comma-separated {kind.__name__}s (got {text!r})")
    if not vals:
        fail(f"{flag}: empty list")
    return vals


def _given(ns: argparse.Namespace, prefix: str, names: list[str]) -> dict:
    return {f: getattr(ns, f"{prefix}_{f}") for f in names if getattr(ns, f"{prefix}_{f}", None) is not None}


def settings(ns: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`klrl.dpo` from the flags (and ``--config`` or the resumed run's
    ``config.json``)."""
    saved = {}
    if ns.resume:  # (a ConfigError: no config.json there)
        saved = json.loads(dpo_config_file(ns.resume).read_text())
        given = [
            k for k, v in vars(ns).items() if v is not None and k.startswith(("dpo_", "data_", "sampling_"))
        ]
        extra = [k for k in given if k != "dpo_iterations"] + [
            k for k in ("betas", "seeds") if getattr(ns, k)
        ]
        if extra or ns.lora_rank or ns.model_path or ns.config:
            fail("--resume: the run's settings come from its config.json; only --dpo.iterations may be given")
    base = load_config_file(ns.config) if ns.config else None
    data = DataConfig(**saved["data"]) if saved else (base.data if base else DataConfig())
    sampling = SamplingConfig(**saved["sampling"]) if saved else (base.sampling if base else SamplingConfig())
    names = lambda c: [f.name for f in dataclasses.fields(c)]
    data = dataclasses.replace(
        data, **_given(ns, "data", [n.split(".")[1] for n, _ in PPO_FIELDS if n.startswith("data")])
    )
    sampling = dataclasses.replace(sampling, **_given(ns, "sampling", ["response_len", "use_eos"]))
    cfg = DPOConfig(**{**saved.get("dpo", {}), **_given(ns, "dpo", names(DPOConfig))})
    if saved:
        lora = LoRAConfig(**saved["lora"])
        model_path = saved["model"]["path"]
        betas = sorted({m[0] for m in saved["members"]}, key=[m[0] for m in saved["members"]].index)
        seeds = sorted({m[1] for m in saved["members"]}, key=[m[1] for m in saved["members"]].index)
    else:
        lora = LoRAConfig(rank=ns.lora_rank, alpha=ns.lora_alpha, targets=ns.lora_targets)
        model_path = ns.model_path or (base.model.path if base else None)
        betas = _floats(ns.betas, "--dpo.betas", float)
        seeds = _floats(ns.seeds, "--dpo.seeds", int)
    if not model_path:
        fail("--model.path: required (the base causal LM), or a --config that names one")
    return dict(
        model_path=model_path, cfg=cfg, lora=lora, data=data, sampling=sampling, betas=betas, seeds=seeds
    )


def run(ns: argparse.Namespace):
    """Check the flags, train, print one line per evaluation and the run directory. The paths, the betas
    and the model are checked by :func:`klrl.checks.preflight_dpo` inside :func:`klrl.api.dpo`: its
    error is the line (the same through either door)."""
    if bool(ns.out) == bool(ns.resume):
        fail("--out: give --out DIR (a new run) or --resume DIR (continue one), not both, not neither")
    try:
        kw = settings(ns)
    except ConfigError as e:
        fail(str(e))
    from klrl.api import dpo  # after the flags: jax is imported here
    from klrl.rewards.pairs import PairsError

    try:
        result = dpo(ns.pairs, run_dir=ns.out or ns.resume, resume=bool(ns.resume), log=print, **kw)
    except ConfigError as e:
        fail(str(e))
    except PairsError as e:
        fail(f"pairs: {e}")
    print(
        f"wrote {result.dir} ({len(result)} member(s); each member's policy/ is an HF directory"
        + (", policy/adapter a PEFT adapter)" if kw["lora"].rank else ")")
    )
    return result


def main(argv: list[str]) -> int:
    """``klrl dpo [flags]``."""
    ns = dpo_parser().parse_args(argv)
    try:
        run(ns)
    except OSError as e:
        fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
    return 0

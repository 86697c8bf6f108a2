"""The frozen reference in checkpoints: left out, identified by its digest, put back at a restore.

A frozen reference (``kl.ref_update_every`` 0) is the task's loaded parameters: the initial policy of full
fine-tuning, or the base that a LoRA run's adapters sit on (klrl.models.lora). Saving it with every
checkpoint would store the model again and again (a LoRA run's checkpoint would be mostly base), so a
checkpoint holds the rest of the state (adapters or policy, heads, optimiser, controller) and its meta
records ``frozen_ref = {path, digest}``: ``model.path`` and the sum digest of the reference's arrays
(:mod:`klrl.io.digest`, the one the checkpoints' own arrays have). A resume rebuilds the reference from
``model.path`` as the run did, checks the digest and puts it back in the state; a changed base (another
file at the same path, another quantisation) is refused in one line. Checkpoints written before this
(with ``ref_params`` inside) are still restored as they are.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from klrl.config import ConfigError
from klrl.io.digest import digests

KEY = "frozen_ref"


def identity(prog: Any) -> dict[str, str] | None:
    """``{path, digest}`` of ``prog``'s frozen reference (None: it is not frozen); one digest over the
    per-array digests, in path order."""
    if prog.frozen_ref is None:
        return None
    per_array = digests(prog.frozen_ref())
    text = json.dumps(sorted((k, v[2]) for k, v in per_array.items()))
    return {"path": prog.configs[0].model.path, "digest": hashlib.sha256(text.encode()).hexdigest()[:32]}


def without(prog: Any, state: Any) -> Any:
    """``state`` as a checkpoint holds it: without a frozen reference."""
    return state._replace(ref_params=None) if prog.frozen_ref is not None else state


def saved_with_reference(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's arrays include ``ref_params`` (written before references were left out)."""
    return any(str(k).startswith("ref_params/") for k in (meta.get("arrays") or {}))


def restored(prog: Any, state: Any, meta: dict[str, Any], where: str) -> Any:
    """A restored ``state`` with its frozen reference put back, once the base's digest matched the one
    the checkpoint recorded (a :class:`ConfigError` naming ``model.path`` otherwise)."""
    if prog.frozen_ref is None or getattr(state, "ref_params", None) is not None:
        return state
    saved = meta.get(KEY)
    if saved is not None:
        now = identity(prog)
        if now["digest"] != saved.get("digest"):
            raise ConfigError(
                f"model.path: the frozen base {now['path'] or '(klrl GPT)'} is not the one {where} was "
                f"trained on (digest {now['digest'][:12]} != {str(saved.get('digest'))[:12]}, recorded for "
                f"{saved.get('path') or '(klrl GPT)'}); resume with the original model file"
            )
    return state._replace(ref_params=prog.frozen_ref())

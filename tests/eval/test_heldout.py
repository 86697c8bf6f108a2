"""klrl.eval.heldout.evaluate_runs: every checkpoint of every member of a (DPO) sweep, after the reference
once, is exactly :func:`klrl.eval.heldout.evaluate` of that member's policy read by ``policy_at`` (the
direct call), with the proxies built once from the base; the reference's rows have zero KL."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from klrl.data.prompts import load_prompts
from klrl.eval import gold
from klrl.eval.heldout import evaluate, evaluate_runs
from klrl.eval.policy import policy_at
from klrl.eval.score import Judge

GGUF = Path(__file__).parents[1] / "data" / "tiny_gguf" / "tiny.gguf"


def test_evaluate_runs_is_evaluate_at_every_checkpoint_of_every_member(tmp_path):
    import klrl
    from klrl.config import DataConfig, LoRAConfig, SamplingConfig

    words = "ab cd ef gh ij kl".split()
    recs = [{"prompt": words[i % 6], "chosen": f"yes {words[(i + 1) % 6]}", "rejected": words[(i + 2) % 6]}
            for i in range(20)]  # fmt: skip
    cfg = klrl.DPOConfig(
        lr=3e-2, batch_size=4, iterations=2, eval_every=0, checkpoint_every=1, eval_prompts=0
    )
    text = {"data": DataConfig(chat_template=False, prompt_len=8), "sampling": SamplingConfig(response_len=4)}
    lora, out = LoRAConfig(rank=4), tmp_path / "r"
    r = klrl.dpo(recs, model_path=GGUF, cfg=cfg, betas=[0.1, 1.0], lora=lora, run_dir=out, **text)
    dirs = [m.dir for m in r.members]
    data = DataConfig(chat_template=False, prompt_len=8, eval_fraction=0.01)  # 4 held-out prompts
    judge, free = Judge.load(str(GGUF)), gold.calibrate([1.0, 2.0, 3.0], [0.1, 0.2, 0.3])
    built, logged = [], []
    length = lambda prompts, responses: np.array([len(x) for x in responses], float)
    proxies = lambda src: built.append(src) or {"len": length}
    rows = evaluate_runs(dirs, judge, free, data, max_new=4, proxies=proxies, seed=5,
                         log=lambda j, s, summ: logged.append((j, s)))  # fmt: skip
    pool = load_prompts(data, r.tokenizer).eval
    assert len(built) == 1 and len(pool) == 4 and logged == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert [(x["member"], x["step"]) for x in rows] == [(-1, 0)] * 4 + [p for p in logged for _ in range(4)]
    assert all(x["kl"] == 0 for x in rows[:4]) and all(x["proxy_len"] == len(x["completion"]) for x in rows)
    src, base = policy_at(dirs[1], 2), built[0]
    direct = evaluate((src.model, src.params), (base.model, base.ref_params), src.tok, pool, judge, free,
                      max_new=4, proxies={"len": length}, seed=5)  # fmt: skip
    got = [{k: v for k, v in x.items() if k not in ("member", "step")} for x in rows[-4:]]
    assert got == direct and any(x["kl"] > 0 for x in direct)
    # a continued run: only the steps not evaluated yet, without the reference's rows, the same records
    later = evaluate_runs(
        dirs, judge, free, data, max_new=4, proxies=proxies, seed=5, skip=(1,), reference=False
    )
    assert later == rows[12:] and {x["step"] for x in later} == {2}

"""Evaluation below the loop: a run's policy at a step, sampling, the exact sequence KL, an independent
judge's likelihood and relevance, and a gold reward that reads the prompt.

``klrl generate`` / ``klrl eval`` (:mod:`klrl.cli.generate`) and the real-LM studies
(``experiments/``) use these same functions:

* :mod:`klrl.eval.policy`: :func:`~klrl.eval.policy.load_source` (a run, a checkpoint, an export or a
  model), :func:`~klrl.eval.policy.policy_at` (a run at a step, LoRA merged),
  :func:`~klrl.eval.policy.checkpoint_steps`;
* :mod:`klrl.eval.sample`: :func:`~klrl.eval.sample.sample` and :func:`~klrl.eval.sample.decode`;
* :mod:`klrl.eval.score`: :func:`~klrl.eval.score.exact_kl`, :class:`~klrl.eval.score.Judge`
  (NLL with or without the prompt, relevance as PMI);
* :mod:`klrl.eval.gold`: the gold of the issue-47 study (VADER sentiment, repetition, fluency, relevance);
* :mod:`klrl.eval.diversity`: distinct-n and the share of cross-prompt near-duplicates;
* :mod:`klrl.eval.heldout`: one held-out evaluation of a policy with every response's record.
"""

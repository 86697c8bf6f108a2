"""Run directories, metrics.jsonl, TensorBoard event files and orbax checkpoints."""

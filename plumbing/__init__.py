"""The run around the method: options and the command line, models and tokenizers, sharding and memory, LoRA,
checkpoints and the run's directory, metrics and statistics, the cold start's data, the simulated users by name.
A first reader skips this folder; the entry points at the root (grpo.py, sft.py, eval.py) call into it.

Nothing here imports an entry point (tests/test_layout.py)."""

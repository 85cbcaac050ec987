"""Two processes over gloo (torchrun, tests/test_sharding.py): each loads one checkpoint through models.load_model
with the launcher's FSDP CPU-RAM-efficient loading switched on (the setting that zeroes weights off rank 0 in
transformers 5.17), then runs shard.check_same_weights on it; in mode `differ`, rank 1 changes its copy first; in mode `raw`, each
loads with transformers' own from_pretrained instead (what muarl guards against). Rank 0
writes what every process saw."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plumbing import cli  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import shard  # noqa: E402


def main():
    mode, ckpt, out_path = sys.argv[1:4]
    acc = cli.make_accelerator()  # joins torchrun's processes over gloo
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    if mode == "raw":  # the negative control: transformers' own loading, without models.load_model's guard
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    else:
        model, _ = models.load_model(ckpt, device="cpu", dtype=torch.float32)
    restored = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    if mode == "differ" and acc.process_index == 1:
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    try:
        shard.check_same_weights(acc, model, f"--agent {ckpt}", "eval.py")
        seen = "same"
    except SystemExit as e:
        seen = str(e)
    every = [None] * acc.num_processes
    dist.all_gather_object(every, {"seen": seen, "checksum": shard.weights_checksum(model), "restored": restored})
    if acc.is_main_process:
        with open(out_path, "w") as f:
            json.dump(every, f)
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

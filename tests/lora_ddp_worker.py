"""One process of tests/test_sharding.py's two-process LoRA test under DDP (started by torchrun over gloo):

    python -m torch.distributed.run --nproc_per_node 2 tests/lora_ddp_worker.py step OUT_JSON

Each process builds the same tiny model with the same adapters (seeded; B made non-zero so that A gets a gradient
too), takes its whole groups of the same 8 episodes, and runs grpo.train_on_episodes once through the Accelerator
grpo.main makes (DDP over gloo here), with plain SGD at lr 1 and no clipping, so the adapters' change is minus their
gradient. `one_step` is also what the test runs in one process, on all 8 episodes: the two must agree.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from plumbing import cli  # noqa: E402
import grpo  # noqa: E402
from plumbing import lora  # noqa: E402
from plumbing import models  # noqa: E402
import muarl  # noqa: E402
from conftest import TEST_CORPUS  # noqa: E402

GROUPS, GROUP_SIZE = 4, 2


def episodes(tok):
    """GROUPS x GROUP_SIZE fixed episodes of different lengths, with mixed rewards in every group; a group's episodes
    begin with the same 8 untrained tokens (its opening)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(GROUPS * GROUP_SIZE):
        n = 24 + 5 * i
        ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
        if i % GROUP_SIZE:
            ids[:8] = out[-1].input_ids[:8]
        mask = [0] * 8 + [1] * (n - 8)
        out.append(muarl.Episode(task_id=f"t{i // GROUP_SIZE}", sample=i % GROUP_SIZE, input_ids=ids, loss_mask=mask,
                                 logprobs=[-1.0] * n, reward=float((i + i // GROUP_SIZE) % 2)))
    return out


def one_step(acc, **options) -> dict:
    """This process's groups, one update (grpo.Config `options`); returns the adapters after it (name -> list) and
    before it."""
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    torch.manual_seed(0)
    cfg = models.tiny_config(len(tok), arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            pad_token_id=tok.pad_token_id, eos_token_id=muarl.end_of_turn_id(tok))
    model = lora.add_adapters(Qwen3ForCausalLM(cfg), rank=4, alpha=0, dropout=0.0, targets=lora.DEFAULT_TARGETS,
                              base="tiny")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt = acc.prepare(model, opt)
    eps = episodes(tok)
    mine = [e for i, e in enumerate(eps) if (i // GROUP_SIZE) % acc.num_processes == acc.process_index]
    run_cfg = grpo.Config(**{**dict(group_size=GROUP_SIZE, micro_batch_size=2, kl_coef=0.1, grad_clip=1e9,
                                     temperature=1.0, lora_rank=4), **options})
    ref = acc.unwrap_model(model)  # the reference: the policy with its adapters off
    m = grpo.train_on_episodes(mine, model, ref, opt, sched, acc, run_cfg, tok.pad_token_id)
    after = {n: p.detach() for n, p in acc.unwrap_model(model).named_parameters() if p.requires_grad}
    return {"after": {n: after[n].flatten().tolist() for n in after},
            "before": {n: before[n].flatten().tolist() for n in before},
            "kl": m["kl"], "unshared_groups": m["unshared_groups"]}


if __name__ == "__main__":
    import hashlib

    from accelerate.utils import gather_object

    acc = cli.make_accelerator()
    result = one_step(acc)
    result["processes"] = acc.num_processes
    mine = hashlib.sha256(json.dumps(result["after"], sort_keys=True).encode()).hexdigest()
    result["hashes"] = gather_object([mine])  # every process ends with the same adapters
    if acc.is_main_process:
        with open(sys.argv[-1], "w") as f:
            json.dump(result, f)
    acc.wait_for_everyone()
    acc.end_training()

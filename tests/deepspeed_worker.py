"""One process of tests/test_sharding.py's two-process DeepSpeed runs (started by torchrun; see that file).

    python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_worker.py grads|rollout STAGE OUT_JSON

Each process builds the same tiny model in-process (nothing downloaded), keeps an unsharded copy as the oracle, wraps
the other in a DeepSpeed engine (`deepspeed.initialize`, ZeRO stage STAGE, on DeepSpeed's CPU accelerator over
gloo) with the config shard.configure_deepspeed makes, and writes what it measured; rank 0 writes OUT_JSON.
"""
import copy
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from plumbing import cli  # noqa: E402
import grpo  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing import shard  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from conftest import TEST_CORPUS, chatty  # noqa: E402
from fake_env import FakeEnv  # noqa: E402
from fast import opening  # noqa: E402
from fsdp2_worker import (episode_steps, finish, sharing, grad_batch, one_process_backward, one_process_sgd_steps,  # noqa: E402
                          perturbed, tiny_model)
from fast.logprobs import token_logprobs  # noqa: E402
from loss import grpo_loss  # noqa: E402


def ds_config(acc, stage, grad_clip):
    """The config grpo.main hands to Accelerate, after shard.configure_deepspeed (Accelerate's own DeepSpeed branch
    is not run on CPU: the engine is made by deepspeed.initialize, as Accelerate's prepare makes it)."""
    # Nothing stays gathered between forwards (DeepSpeed keeps small parameters and recently used ones whole by
    # default, which on a model this small would hide a missing gather: decoding would then need no collective).
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    config = {"zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    fake = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)),
                           num_processes=acc.num_processes)
    shard.configure_deepspeed(fake, micro_batch_size=1, grad_clip=grad_clip)
    return config


def engine_for(model, opt, config):
    engine = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]
    shard.expose_head(engine)
    return engine


def grads(acc, tok, tied, stage):
    """The GRPO loss's gradients under a DeepSpeed engine over 2 processes (each half the rows, two micro-batches
    through shard.micro_batch / shard.backward, the loss times the number of processes and one global normalizer, as
    grpo.train_on_episodes) vs one process on all rows; then shard.optimizer_step (engine.step: clip, AdamW) vs the
    same step on one process, and shard.full_state_dict vs the one-process weights."""
    rank, world = acc.process_index, acc.num_processes
    policy = tiny_model(tok, tied)
    ref = perturbed(policy)
    plain, plain_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    names = [n for n, _ in plain.named_parameters()]
    config = ds_config(acc, stage, grad_clip=0.5)
    engine = engine_for(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0), config)
    ref_engine = shard.deepspeed_reference(ref, config)
    ids, attn, mask, adv, old, N = grad_batch(tok, world, plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    out = {"head_is_partitioned": engine.module.get_output_embeddings().weight.numel() == 0}
    for it in range(2):
        ref_lp = one_process_backward(plain, plain_ref, ids, attn, mask, adv, old, N)
        want = {n: p.grad.clone() for n, p in plain.named_parameters()}  # before clipping
        want_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
        ref_diff, rows = 0.0, (2 * rank, 2 * rank + 1)
        for k, r in enumerate(rows):  # this process's rows, one micro-batch each
            sl = slice(r, r + 1)
            with shard.micro_batch(acc, engine, last=k == len(rows) - 1):
                logp = token_logprobs(engine, ids[sl], attn[sl], temperature=0.7)
                with torch.no_grad():
                    ref_lp_sharded = token_logprobs(ref_engine, ids[sl], attn[sl], temperature=0.7)
                ref_diff = max(ref_diff, float(((ref_lp_sharded - ref_lp[sl]) * attn[sl]).abs().max()))
                loss, _ = grpo_loss(logp, old[sl], ref_lp_sharded, adv[sl], mask[sl], kl_coef=0.1, normalizer=N)
                shard.backward(acc, engine, loss * world)
        # Before clipping: the gradients DeepSpeed reduced, whole (a collective), against the one-process ones.
        got = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        grad_diff = max(float((got[n] - want[n]).abs().max()) for n in names)
        norm, stepped = shard.optimizer_step(acc, engine, None, 0.5)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        state = shard.full_state_dict(acc, engine)  # whole on the main process only, which writes the result
        if not acc.is_main_process:
            assert state == {}, sorted(state)[:3]
            continue
        out[f"iter{it}"] = {"grad_diff": grad_diff, "grad_scale": max(float(w.abs().max()) for w in want.values()),
                            "norm": [norm, want_norm],
                            "stepped": stepped, "ref_logp_diff": ref_diff,
                            "weight_diff": max(float((state[n] - p.detach()).abs().max())
                                               for n, p in plain.named_parameters()),
                            "state_keys_match": sorted(state) == sorted(names)}
    return out


def rollout_then_train(acc, tok, stage):
    """A greedy rollout inside shard.full_weights of a DeepSpeed engine, where the processes decode different numbers
    of steps, vs the unsharded copy; then grpo.train_on_episodes with the engine (and a DeepSpeed reference) on those
    episodes vs one process on all of them."""
    rank, world = acc.process_index, acc.num_processes
    policy = chatty(tiny_model(tok, tied=True, init=0.3), tok, rate=0.2).train()
    ref = perturbed(policy, scale=0.05)
    plain, plain_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    cfg = grpo.Config(group_size=2, micro_batch_size=1, kl_coef=0.1, lr=1.0, grad_clip=0.5, max_context=400,
                      temperature=1.0)  # the oracle scores at temperature 1
    config = ds_config(acc, stage, cfg.grad_clip)
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr)  # SGD: the step is the clipped gradient itself
    engine = engine_for(policy, opt, config)
    ref_engine = shard.deepspeed_reference(ref, config)
    env = FakeEnv(n_tasks=4)
    tasks = env.tasks("train")[rank::world]
    sampling = RolloutConfig(greedy=True, max_new_tokens=(8, 24)[rank], max_context=400)
    steps = episode_steps(engine.module)
    with shard.full_weights(engine, "cpu") as decoder:
        eps = rollout(acc.unwrap_model(decoder), tok, env, tasks, cfg.group_size, make_user_sim("scripted"), sampling)
    want = rollout(plain, tok, env, tasks, cfg.group_size, make_user_sim("scripted"), sampling)
    all_steps = [None] * world
    dist.all_gather_object(all_steps, steps[0])
    same = all(a.input_ids == b.input_ids and a.loss_mask == b.loss_mask for a, b in zip(eps, want))
    lp_diff = max(abs(x - y) for a, b in zip(eps, want) for x, y in zip(a.logprobs, b.logprobs))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    engine.train()
    shared = sharing(opening)  # micro-batches scored through their group's opening computed once
    met = grpo.train_on_episodes(eps, engine, ref_engine, opt, sched, acc, cfg, tok.pad_token_id)
    want_loss, want_norm = one_process_sgd_steps(plain, plain_ref, eps, tok, cfg)
    state = shard.full_state_dict(acc, engine)  # whole on the main process (rank 0 writes the result), {} elsewhere
    held = [None] * world
    dist.all_gather_object(held, len(state))
    return {"steps": all_steps, "same_tokens": same, "episodes": len(eps), "logprob_diff": lp_diff,
            "grad_norm": [met["grad_norm"], want_norm], "loss": [met["loss"], want_loss], "state_held": held,
            "weight_diff": max(float((state[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
            if state else None, "skipped": met["skipped_updates"], "shared": shared[0],
            "unshared_groups": met["unshared_groups"]}


def main():
    mode, stage, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    acc = cli.make_accelerator()  # joins torchrun's processes over gloo, as grpo.main does here
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    if mode == "grads":
        result = {f"tied={t}": grads(acc, tok, t, stage) for t in (True, False)}
    else:
        result = rollout_then_train(acc, tok, stage)
    finish(acc, out_path, result)


if __name__ == "__main__":
    main()

"""One process of tests/test_sharding.py's two-process FSDP2 runs (started by torchrun; see that file).

    python -m torch.distributed.run --nproc_per_node 2 tests/fsdp2_worker.py grads|rollout|recipe|checkpoint|refused OUT_JSON

Each process builds the same tiny model in-process (nothing downloaded), keeps an unsharded copy as the oracle,
shards the other with raw `fully_shard` over a CPU mesh, and writes what it measured; rank 0 writes OUT_JSON.
"""
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from plumbing import cli  # noqa: E402
import grpo  # noqa: E402
from plumbing import models  # noqa: E402
import muarl  # noqa: E402
from plumbing import shard  # noqa: E402
from fast import opening  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from conftest import TEST_CORPUS, chatty  # noqa: E402
from fake_env import FakeEnv  # noqa: E402
from fast.logprobs import token_logprobs  # noqa: E402
from loss import group_advantages, grpo_loss  # noqa: E402


def tiny_model(tok, tied, init=0.02):
    torch.manual_seed(0)
    cfg = models.tiny_config(len(tok), arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=init,
                            tie_word_embeddings=tied, pad_token_id=tok.pad_token_id,
                            eos_token_id=muarl.end_of_turn_id(tok))
    return Qwen3ForCausalLM(cfg)


def perturbed(model, seed=1, scale=0.02):
    """A frozen reference a little away from the policy, so the KL term has a gradient."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return ref


def fsdp2(model, mesh, layout="accelerate"):
    """Shard `model` as Accelerate's FSDP2 does (1.15, fsdp2_prepare_model; layout "accelerate": each decoder layer,
    the input embedding its own unit unless tied, the tail [final norm, (tied embedding,) output layer] one unit
    that stays gathered after its forward, then the root), or by the plain recipe (layout "layers": each decoder
    layer, then the root, which then holds the norm and the output layer)."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "accelerate":
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = emb.weight is head.weight
        if not tied:
            fully_shard(emb, mesh=mesh)
        fully_shard([model.model.norm, emb, head] if tied else [model.model.norm, head], mesh=mesh,
                    reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_diff(a, b):
    return max(float((full(x) - y).abs().max()) for x, y in zip(a, b))


def grad_batch(tok, world, plain):
    """Two rows per process of random tokens, ragged attention, a random loss mask, fixed advantages and sampler
    log-probs a little off the plain model's: (ids, attn, mask, adv, old, normalizer)."""
    g = torch.Generator().manual_seed(2)
    B, T = 2 * world, 14
    ids = torch.randint(0, len(tok), (B, T), generator=g)
    attn = (torch.arange(T)[None] < torch.tensor([14, 9, 12, 6])[:, None]).long()
    mask = attn * (torch.rand(B, T, generator=g) < 0.7).long()
    mask[:, 0] = 0
    adv = torch.tensor([1.0, -0.5, -1.2, 0.8])
    with torch.no_grad():
        old = token_logprobs(plain, ids, attn, temperature=0.7) + 0.3 * torch.randn(B, T, generator=g)
    return ids, attn, mask, adv, old, float(mask.sum())


def one_process_backward(plain, plain_ref, ids, attn, mask, adv, old, N):
    """The oracle's backward of the GRPO loss on all rows (kl_coef 0.1, temperature 0.7); returns the reference's
    log-probs."""
    logp = token_logprobs(plain, ids, attn, temperature=0.7)
    with torch.no_grad():
        ref_lp = token_logprobs(plain_ref, ids, attn, temperature=0.7)
    loss, _ = grpo_loss(logp, old, ref_lp, adv, mask, kl_coef=0.1, normalizer=N)
    loss.backward()
    return ref_lp


def grads(acc, mesh, tok, tied, layout):
    """The GRPO loss's gradients, FSDP2 over 2 processes (each half the rows, two micro-batches, the loss times the
    number of processes and one global normalizer, as grpo.train_on_episodes) vs one process on all rows; twice,
    with an optimizer step between."""
    rank, world = acc.process_index, acc.num_processes
    policy = tiny_model(tok, tied)
    ref = perturbed(policy)
    plain, plain_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    fsdp2(policy, mesh, layout)
    shard.shard_like(ref, policy)
    ids, attn, mask, adv, old, N = grad_batch(tok, world, plain)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0) for m in (plain, policy)]
    out = {}
    for it in range(2):
        ref_lp = one_process_backward(plain, plain_ref, ids, attn, mask, adv, old, N)
        want_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
        want = [p.grad for p in plain.parameters()]
        ref_diff = 0.0
        for r in (2 * rank, 2 * rank + 1):  # this process's rows, one micro-batch each
            sl = slice(r, r + 1)
            logp = token_logprobs(policy, ids[sl], attn[sl], temperature=0.7)
            with torch.no_grad():
                ref_lp_sharded = token_logprobs(ref, ids[sl], attn[sl], temperature=0.7)
            ref_diff = max(ref_diff, float(((ref_lp_sharded - ref_lp[sl]) * attn[sl]).abs().max()))
            loss, _ = grpo_loss(logp, old[sl], ref_lp_sharded, adv[sl], mask[sl], kl_coef=0.1, normalizer=N)
            (loss * world).backward()
        got_norm = float(shard.plain(acc.clip_grad_norm_(policy.parameters(), 1e9)))
        out[f"iter{it}"] = {"grad_diff": max_diff([p.grad for p in policy.parameters()], want),
                            "grad_scale": max(float(w.abs().max()) for w in want),
                            "norm": [got_norm, want_norm], "ref_logp_diff": ref_diff,
                            "grads_are_dtensors": all(hasattr(p.grad, "full_tensor") for p in policy.parameters())}
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return out


def episode_steps(model):
    """Count the decoder's forward passes (one per decoding step or prefill) on this process."""
    calls = [0]
    model.model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def rollout_then_train(acc, mesh, tok, updates=1, checkpointing=False):
    """A greedy rollout of a sharded model inside shard.full_weights, where the processes decode different numbers
    of steps, vs the unsharded copy; then grpo.train_on_episodes on those episodes (two micro-batches a process;
    `updates` optimizer steps on the batch, --updates-per-batch; with gradient checkpointing if asked) vs one
    process on all of them."""
    rank, world = acc.process_index, acc.num_processes
    policy = chatty(tiny_model(tok, tied=True, init=0.3), tok, rate=0.2).train()
    ref = perturbed(policy, scale=0.05)
    plain, plain_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    if checkpointing:  # before sharding, as pipeline.load enables it before acc.prepare
        policy.gradient_checkpointing_enable()
    fsdp2(policy, mesh)
    shard.shard_like(ref, policy)
    env, G = FakeEnv(n_tasks=4), 2
    tasks = env.tasks("train")[rank::world]
    sampling = RolloutConfig(greedy=True, max_new_tokens=(8, 24)[rank], max_context=400)
    through_fsdp = episode_steps(policy)  # forwards through FSDP's units: only full_weights' first one
    with shard.full_weights(policy, "cpu") as decoder:
        plain_decoder = not shard.is_sharded(decoder) and not any(hasattr(p, "full_tensor")
                                                                  for p in decoder.parameters())
        steps = episode_steps(decoder)
        eps = rollout(decoder, tok, env, tasks, G, make_user_sim("scripted"), sampling)
    fsdp_forwards = through_fsdp[0]
    want = rollout(plain, tok, env, tasks, G, make_user_sim("scripted"), sampling)
    all_steps = [None] * world
    dist.all_gather_object(all_steps, steps[0])
    same = all(a.input_ids == b.input_ids and a.loss_mask == b.loss_mask for a, b in zip(eps, want))
    lp_diff = max(abs(x - y) for a, b in zip(eps, want) for x, y in zip(a.logprobs, b.logprobs))

    cfg = grpo.Config(group_size=G, micro_batch_size=1, kl_coef=0.1, lr=1.0, grad_clip=0.5, max_context=400,
                      temperature=1.0, updates_per_batch=updates)  # the oracle below scores at temperature 1
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr)  # SGD: the step is the clipped gradient itself
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    policy.train()
    shared = sharing(opening)  # micro-batches scored through their group's opening computed once
    met = grpo.train_on_episodes(eps, policy, ref, opt, sched, acc, cfg, tok.pad_token_id)

    want_loss, want_norm = one_process_sgd_steps(plain, plain_ref, eps, tok, cfg)
    return {"steps": all_steps, "fsdp_forwards": fsdp_forwards, "plain_decoder": plain_decoder,
            "checkpointing": bool(getattr(policy, "is_gradient_checkpointing", False)), "same_tokens": same,
            "episodes": len(eps), "logprob_diff": lp_diff,
            "grad_norm": [met["grad_norm"], want_norm], "loss": [met["loss"], want_loss],
            "weight_diff": max_diff(list(policy.parameters()), list(plain.parameters())),
            "skipped": met["skipped_updates"], "shared": shared[0],
            "unshared_groups": met["unshared_groups"]}


def sharing(opening_module):
    """Count the micro-batches the update scores through their group's opening computed once (--share-opening,
    fast.opening.micro_batch_logprobs)."""
    count, real = [0], opening_module.shared_opening_logprobs

    def counted(*a, **k):
        count[0] += 1
        return real(*a, **k)
    opening_module.shared_opening_logprobs = counted
    return count


def one_process_sgd_steps(plain, plain_ref, eps, tok, cfg):
    """The oracle of grpo.train_on_episodes: one process, every process's episodes in one batch; per update one
    backward, clip, SGD step (on `plain`, in place), the old log-probs those of the first. Returns (the updates' mean
    loss, their mean gradient norm before clipping)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [(e.input_ids, e.loss_mask, e.reward, e.infra_failed) for e in eps])
    every = [e for part in every for e in part]
    ids, attn, mask = muarl.collate([(i, m) for i, m, _, _ in every], tok.pad_token_id)
    adv = group_advantages(torch.tensor([r for _, _, r, _ in every]), cfg.group_size,
                                valid=torch.tensor([not f for *_, f in every]))
    with torch.no_grad():
        ref_lp = token_logprobs(plain_ref, ids, attn)
        old = token_logprobs(plain, ids, attn)
    losses, norms = [], []
    for _ in range(cfg.updates_per_batch):
        logp = token_logprobs(plain, ids, attn)
        loss, _ = grpo_loss(logp, old if cfg.updates_per_batch > 1 else logp.detach(), ref_lp, adv, mask,
                            kl_coef=cfg.kl_coef, normalizer=float(mask.sum()))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)))
        with torch.no_grad():
            for p in plain.parameters():
                p -= cfg.lr * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses), sum(norms) / len(norms)


def checkpoint(acc, mesh, tok, out_dir):
    """A checkpoint of a sharded policy after one AdamW step, as grpo.py writes it: save_state's model and optimizer
    through Accelerate's own FSDP functions with the plugin cli.sharded_checkpoints sets (each process writes its
    shards), loaded into a fresh sharded model and optimizer; and the model directory's weights
    (shard.full_state_dict), whole on the main process only."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"  # the accelerate config's other answer: overridden
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    cli.sharded_checkpoints(plugin)

    def trained(seed):
        policy = tiny_model(tok, tied=False)
        torch.manual_seed(seed)
        plain = copy.deepcopy(policy)
        fsdp2(policy, mesh)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        ids = torch.randint(0, len(tok), (2, 9))
        token_logprobs(policy, ids, torch.ones_like(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
        return policy, opt, plain

    policy, opt, plain = trained(0)
    save_fsdp_model(plugin, acc, policy, out_dir)
    save_fsdp_optimizer(plugin, acc, opt, policy, out_dir)
    acc.wait_for_everyone()
    fresh, fresh_opt, _ = trained(1)  # other data: other weights and moments until loaded
    differed = max_diff(list(fresh.parameters()), [full(p) for p in policy.parameters()]) > 0
    load_fsdp_model(plugin, acc, fresh, out_dir)
    load_fsdp_optimizer(plugin, acc, fresh_opt, fresh, out_dir)
    weights = max(float((a.to_local() - b.to_local()).abs().max()) for a, b in zip(fresh.parameters(),
                                                                                      policy.parameters()))
    moments = max(float((fresh_opt.state[a][k].to_local() - opt.state[b][k].to_local()).abs().max())
                  for a, b in zip(fresh.parameters(), policy.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    whole = shard.full_state_dict(acc, policy)
    want = {n: full(p) for n, p in policy.named_parameters()}
    got = {n: (tuple(t.shape), t.device.type, float((t - want[n]).abs().max())) for n, t in whole.items()}
    return {"state_dict_type": str(plugin.state_dict_type), "differed": differed, "weights": weights,
            "moments": moments, "whole": got, "params": len(want),
            "files": sorted(str(p.relative_to(out_dir)) for p in __import__("pathlib").Path(out_dir).rglob("*")
                            if p.is_file())}


def refused(acc, mesh, tok, out_dir):
    """Process 1's disk refuses its shard while FSDP2's sharded checkpoint is written (torch.distributed.checkpoint):
    what disk.agreed raises on each process, and the line disk.refused makes of it."""
    import errno
    from pathlib import Path

    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import save_fsdp_model
    from torch.distributed.checkpoint import filesystem

    from plumbing import disk

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    cli.sharded_checkpoints(plugin)
    policy = tiny_model(tok, tied=False)
    fsdp2(policy, mesh)
    if acc.process_index == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        filesystem.FileSystemWriter.write_data = full
    try:
        disk.agreed(acc, lambda: save_fsdp_model(plugin, acc, policy, out_dir))
    except BaseException as e:
        line = disk.refused(Path(out_dir), "writing the checkpoint", e, "The partial copy was removed")
        return {"raised": type(e).__name__, "line": str(line.code)}
    return {"raised": None}


def main():
    mode, out_path = sys.argv[1], sys.argv[2]
    acc = cli.make_accelerator()  # joins torchrun's processes over gloo, as grpo.main does
    mesh = init_device_mesh("cpu", (acc.num_processes,))
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    if mode == "grads":
        result = {f"tied={t} {layout}": grads(acc, mesh, tok, t, layout) for t in (True, False)
                  for layout in ("layers", "accelerate")}
    elif mode == "checkpoint":
        result = checkpoint(acc, mesh, tok, os.path.join(os.path.dirname(out_path), "ckpt"))
        every = [None] * acc.num_processes
        dist.all_gather_object(every, result)
        result = every
    elif mode == "refused":
        result = refused(acc, mesh, tok, os.path.join(os.path.dirname(out_path), "ckpt"))
        every = [None] * acc.num_processes
        dist.all_gather_object(every, result)
        result = every
    elif mode == "recipe":  # what a GPU run configures besides: gradient checkpointing, --updates-per-batch 2
        result = rollout_then_train(acc, mesh, tok, updates=2, checkpointing=True)
    else:
        result = rollout_then_train(acc, mesh, tok)
    finish(acc, out_path, result)


def finish(acc, out_path, result):
    """Rank 0 writes the result; then every process leaves the process group."""
    if acc.is_main_process:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

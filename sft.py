"""sft.py: cold-start SFT on multi-turn tool-use conversations (made: plumbing/coldstart.py; read from a file:
plumbing/conversations.py), the `tiny` base's pretraining, and the cached cold start grpo.py makes for `tiny` when it
is given none.

The paper fine-tunes on ~2,000 multi-turn trajectories before RL. Here the conversations are JSONL lines in
OpenAI format, {"messages": [...], "tools": [...]}, tokenized exactly as the rollout tokenizes an episode
(muarl.encode_conversation) so that SFT and RL train on the same layout and the same loss mask: only the
assistant's tokens (its text, tool calls and end-of-turn token) are trained. An optional "prompt_messages": n
makes the first n messages prompt (a task that continues an earlier conversation: its agent turns are not trained).

    ./run accelerate launch sft.py --data convs.jsonl --model Qwen/Qwen3-8B --out runs/sft-qwen3
    ./run python sft.py --teacher expert --env shop --out runs/coldstart     # make data with the scripted expert
    ./run python sft.py --teacher gpt-4o --env tau2:retail --user-sim openai --data-out retail.jsonl --epochs 0

Cold-start data: a teacher (shop's scripted expert, or an OpenAI-compatible model) plays tasks against the environment
and a user simulator; episodes with reward 1 are kept (from an imperfect expert: those whose database is right).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import torch

from plumbing import checkpoints, cli, disk, lora, memory, models, shard
from plumbing.cli import SEEDS, Range
from plumbing import coldstart
from plumbing.coldstart import (NothingFits, Untokenizable, copy_loss, drills, encode, length_limit, make_cold_start,
                                nothing_fits, teacher_data, windows)
from plumbing.conversations import check_data_options, check_data_out, load_conversations
from envs import make_env
from envs.shop_tasks import SIBLINGS, relabel_goods
from fast.logprobs import token_logprobs
from muarl import collate
from plumbing.options import AttentionOptions, LoraOptions, SFTData, UserOptions, check_activation_checkpointing
from plumbing.users import check_user_sim


@dataclass
class SFT:
    """SFT: training"""
    epochs: Annotated[float, Range("[0, inf)")] = 1.0
    """passes over the data (0: only synthesize data)"""
    lr: Annotated[float, Range("(0, inf)")] = 4e-3
    """peak learning rate (the paper: 5e-6 for Qwen3; a tiny model from scratch needs far more)"""
    warmup_steps: Annotated[int, Range("[0, inf)")] = 10
    """linear warm-up steps, then cosine decay to 10% of the peak"""
    batch_size: Annotated[int, Range("[1, inf)")] = 8
    """conversations per optimizer step, over all processes (the paper: 128)"""
    micro_batch_size: Annotated[int, Range("[1, inf)")] = 4
    """conversations per forward/backward pass on one process"""
    max_len: Annotated[int, Range("[0, inf)")] = 0
    """conversations longer than this many tokens are skipped (and counted), never cut; 0: the model's context
    (max_position_embeddings), so every conversation the model can read is kept (a tau2 retail opening: ~4.7k)"""
    weight_decay: Annotated[float, Range("[0, inf)")] = 0.0
    """AdamW weight decay"""
    grad_clip: Annotated[float, Range("(0, inf)")] = 1.0
    """gradient-norm clip"""
    bf16: bool = False
    """bf16 mixed precision: fp32 master weights, forward passes under bf16 autocast (GPU)"""
    gradient_checkpointing: bool = False
    """trade compute for memory on long conversations"""
    seed: Annotated[int, SEEDS] = 0
    """seed for data order, initialization of 'tiny' and the teacher's episodes"""


@dataclass
class SFTConfig(AttentionOptions, LoraOptions, UserOptions, SFTData, SFT):
    """Cold-start SFT on multi-turn tool-use conversations."""
    user_concurrency: int = 8


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def fit(acc, model, opt, sched, data, steps: int, batch_size: int, micro_batch_size: int, pad_id: int,
        seed: int, grad_clip: float, tag: str, log_every: int = 10) -> float:
    """`steps` optimizer steps of `batch_size` sequences drawn in seeded epochs: token-mean NLL of the masked tokens,
    one normalizer per step over all micro-batches and processes (docs/invariants.md, 3). Returns the mean loss."""
    rng, order, t0 = random.Random(seed), [], time.time()
    run_loss = torch.zeros((), device=acc.device)
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            perm = list(range(len(data)))
            rng.shuffle(perm)
            order += perm
        batch, order = [data[i] for i in order[:batch_size]], order[batch_size:]
        normalizer = sum(sum(m) for _, m in batch)
        mine = batch[acc.process_index::acc.num_processes]
        micro = [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        total_loss = torch.zeros((), device=acc.device)
        for k, mb in enumerate(micro):
            ids, attn, mask = collate(mb, pad_id, acc.device)
            with shard.micro_batch(acc, model, last=k == len(micro) - 1):  # as grpo.train_on_episodes
                # token_logprobs runs the model's body, not model.forward, which is what Accelerate's prepare wraps
                # in autocast: ask for it here, as grpo.train_on_episodes does.
                with acc.autocast():
                    logp = token_logprobs(model, ids, attn)
                # DDP averages gradients over processes; scale so the sum over processes is the global mean.
                loss = -(logp * mask).sum() / normalizer * acc.num_processes
                shard.backward(acc, model, loss)
            total_loss += loss.detach() / acc.num_processes
        grad_norm, _ = shard.optimizer_step(acc, model, opt, grad_clip)  # a non-finite norm skips the step
        sched.step()
        run_loss += total_loss
        if log_every and (step % log_every == 0 or step == steps - 1):
            loss_all = acc.reduce(total_loss, reduction="sum").item()
            acc.print(f"[sft] {tag}step {step + 1}/{steps} loss {loss_all:.4f} grad_norm {float(grad_norm):.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")
    return acc.reduce(run_loss, reduction="sum").item() / max(1, steps)


def check_backend(acc, gradient_checkpointing: bool = False) -> None:
    """Refuse at start what the loop does not implement (FSDP1, ZeRO-1, ...) and two activation checkpointings."""
    shard.check_accelerator(acc, program="sft.py")
    check_activation_checkpointing(acc, gradient_checkpointing, "sft.py")


def check_lora(cfg: SFTConfig, acc=None) -> None:
    """The --lora-* options, the backend with them (given `acc`), and that --out is not the base they train on."""
    lora.check_options(cfg, "sft.py")
    if cfg.lora_rank and acc is not None:
        lora.check_backend(acc, "sft.py")
    if cfg.lora_rank and cfg.model != "tiny":
        lora.check_base_kept(cfg.model, cfg.out, "sft.py: --out")


def check_batch(batch_size: int, processes: int) -> None:
    """Every process must run the same number of micro-batches: under FSDP2 and ZeRO-3 each backward is a collective,
    and a process with one more would wait for the others forever."""
    if batch_size < processes or batch_size % processes:
        raise SystemExit(f"sft.py: --batch-size {batch_size} must be a multiple of the number of processes "
                         f"({processes}), so that every process trains on as many conversations a step")


def train(cfg: SFTConfig, conversations: list[dict], accelerator=None, record: dict | None = None) -> Path:
    """Fine-tune on the conversations; returns the checkpoint directory. 'tiny' starts from its pretrained base."""
    start = str(pretrain_tiny(SFTConfig(bf16=cfg.bf16))) if cfg.model == "tiny" else cfg.model  # the default base
    acc = accelerator or cli.make_accelerator(cfg.dist_timeout, mixed_precision="bf16" if cfg.bf16 else "no")
    check_backend(acc, cfg.gradient_checkpointing)
    check_lora(cfg, acc)
    check_batch(cfg.batch_size, acc.num_processes)
    memory.check_training(start, cfg, device=acc.device, **shard.memory_backend(acc))
    models.seed_everything(cfg.seed)
    # fp32 master weights, as grpo.main keeps the policy's; --bf16 runs the passes under autocast (fit). AdamW on
    # bf16 weights rounds a step of lr 5e-6 away for most weights (docs/gpus.md); the checkpoint stays fp32 too.
    # Under FSDP2 loaded in host memory and sharded onto the GPUs by acc.prepare (shard.load_device). With LoRA the
    # frozen model is in the compute dtype, the adapters in fp32 (lora.add_adapters).
    compute = torch.bfloat16 if cfg.bf16 else torch.float32
    attn = models.attention_implementation(acc.device, compute, cfg.attn, "sft.py")
    with cli.option_errors("sft.py: --model"):
        model, tok = models.load_model(start, device=shard.load_device(acc), seed=cfg.seed, merge_adapters=True,
                                      dtype=compute if cfg.lora_rank else torch.float32, attn_implementation=attn)
    if cfg.gradient_checkpointing:  # (with LoRA, peft makes the frozen embeddings' output require grad for it)
        model.gradient_checkpointing_enable()
    if cfg.lora_rank:
        model = lora.add_adapters(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                  targets=cfg.lora_target_modules, base=start, program="sft.py", autocast=cfg.bf16)
        acc.print(f"[sft] --lora-rank {cfg.lora_rank}: {lora.describe(model)}")
    max_len = length_limit(cfg, model)
    data, skipped = encode(tok, conversations, max_len)
    if not data:
        raise NothingFits(f"sft.py: --max-len: {nothing_fits(cfg, model, skipped)}")
    total = max(1, int(cfg.epochs * max(1, len(data) // cfg.batch_size)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, total))
    shard.configure_deepspeed(acc, micro_batch_size=cfg.micro_batch_size, grad_clip=cfg.grad_clip, program="sft.py")
    model, opt = acc.prepare(model, opt)
    shard.expose_head(model)
    acc.print(f"[sft] {len(data)} conversations of {min(len(i) for i, _ in data)}-{max(len(i) for i, _ in data)} "
              f"tokens ({len(skipped)} longer than {max_len} skipped: --max-len), {sum(sum(m) for _, m in data)} "
              f"trained tokens, {total} steps of {cfg.batch_size}")
    drawn, asked = total * cfg.batch_size, cfg.epochs * len(data)  # (whole batches: the steps round down)
    if drawn < 0.9 * asked:
        acc.print(f"[sft] warning: {total} step(s) of {cfg.batch_size} draw {drawn} conversations, not the {asked:g} "
                  f"that --epochs {cfg.epochs:g} of {len(data)} asks for: raise --epochs or lower --batch-size")
    if cfg.warmup_steps > total:
        acc.print(f"[sft] warning: --warmup-steps {cfg.warmup_steps} is more than the {total} step(s): the learning "
                  f"rate reaches {total / cfg.warmup_steps:.2g} of --lr {cfg.lr:g} at most")
    trained = checkpoints.trained_weights(model)
    checkpoints.check_room_to_start(acc, Path(cfg.out), (4 * trained, f"{trained:,} trained weights at 4 bytes each"),
                                    f"sft.py: --out {cfg.out}: {{room}}. Nothing was trained: make room, or choose "
                                    "another --out", program="sft.py")
    fit(acc, model, opt, sched, data, total, cfg.batch_size, cfg.micro_batch_size, tok.pad_token_id, cfg.seed,
        cfg.grad_clip, "")
    out = Path(cfg.out)
    checkpoints.save_pretrained(acc, model, tok, out, {"sft": asdict(cfg), **(record or {})},
                                f"train from the data written: --data {cfg.data_out}" if cfg.data_out else
                                "run the same command again", program="sft.py")
    acc.print(f"[sft] checkpoint written to {out}")
    return out


def cold_start(model: str, env: str, split: str, seed: int, bf16: bool, skips_confirm: float,
               skips_ask: float, skips_status: float = 0.0, committed: bool = True) -> str:
    """grpo.py's cold start when it is given none: the model fine-tuned on the scripted teacher's conversations on the
    training split (skipping confirmations in `skips_confirm` of them, never asking what the user wants in
    `skips_ask`, writing before it reads the order's status in `skips_status`), as the paper's pipeline does. For
    `tiny`: from its base (`pretrain_tiny`), on models.TINY_COLD_START's tasks and drills, with the dynamic user and
    one who says its wishes unasked (`cold_start_users`). The committed one (COMMITTED_COLD) when its settings and
    its very conversations are these; else made once and cached under MUARL_CACHE, keyed by them and its code."""
    store, users = coldstart.cold_start_users(env) if model == "tiny" else (env, "")
    # The GRPO run's precision: Accelerate keeps one process-wide state, so an SFT inside it cannot ask for another.
    cfg = SFTConfig(model=model, env=store, split=split, seed=seed, bf16=bf16, teacher_skips_confirm=skips_confirm,
                    teacher_skips_ask=skips_ask, teacher_skips_status=skips_status, teacher_users=users,
                    **({**models.TINY_COLD_START, **models.TINY_COLD_DATA} if model == "tiny" else {}))
    base = pretrain_tiny(SFTConfig(bf16=bf16)) if model == "tiny" else model
    settings = {**{k: getattr(cfg, k) for k in COLD_START_KEYS}, "base": hashlib.sha256(
        (Path(base) / "model.safetensors").read_bytes()).hexdigest()[:16] if model == "tiny" else model}
    made = COMMITTED_COLD / "muarl_config.json"
    committed = (json.loads(made.read_text())["cold_start"]["settings"] if committed and model == "tiny"
                 and made.exists() else {})
    maybe_committed = {k: v for k, v in committed.items() if k != "data"} == settings
    if not maybe_committed:
        models.check_cache("grpo.py")  # before the synthesis and SFT whose checkpoint it is to hold
    t0, data = time.time(), teacher_data(cfg)
    settings["data"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]  # the very data
    if committed == settings:
        cli.main_print(f"[grpo] cold start: the committed one, {COMMITTED_COLD} (its settings and conversations; "
                       f"checked in {time.time() - t0:.0f}s)")
        return str(COMMITTED_COLD)
    if maybe_committed:  # the same settings, other conversations: the domain changed since it was committed
        models.check_cache("grpo.py")
    out = models.CACHE_DIR / f"coldstart-{store.replace(':', '-')}-{model}-{models.cache_key(settings)}"
    if (out / "config.json").exists():
        cli.main_print(f"[grpo] cold start: using the cached SFT checkpoint {out}")
        return str(out)
    cli.main_print(f"[grpo] cold start: no --init-from given, so making one: SFT of {base} ({cfg.epochs:g} epochs) on "
                   f"{len(data)} conversations and drills of the scripted teacher on {store}:{split} (writing without "
                   f"a yes in {skips_confirm:.0%}, --cold-start-skips-confirm; never asking what the user wants in "
                   f"{skips_ask:.0%}, --cold-start-skips-ask) -> {out}")
    cfg.out = str(out)  # its own Accelerator: GRPO's checkpoints hold GRPO's state only
    train(cfg, data, record={"cold_start": {"settings": settings}})
    return str(out)


COLD_START_KEYS = ("env split seed bf16 teacher_skips_confirm teacher_skips_ask teacher_skips_status teacher_users "
                   "num_tasks copy_drills epochs lr batch_size warmup_steps grad_clip weight_decay").split()
# The committed cold start, grpo.py's default start (`./run python sft.py --cold-start-out assets/tiny-cold --overwrite
# --teacher-skips-confirm C --teacher-skips-ask A --teacher-skips-status S`, grpo.py's --cold-start-skips-*, rebuilds
# it).
COMMITTED_COLD = Path(__file__).resolve().parent / "assets" / "tiny-cold"


# The committed base (`./run python sft.py --pretrain-only --base-out assets/tiny-base --overwrite` rebuilds it).
COMMITTED_BASE = Path(__file__).resolve().parent / "assets" / "tiny-base"
# The base's stores under their old policy, users wanting the defaults (the procedure, never the question), their shares
# of its conversations; its teacher never asks, and skips the yes in 30% as the cold start's (COLD_TEACHER) does.
BASE_STORES = {"shop:old:default": 0.5, **{f"shop:{g}:old:default": 0.5 / len(SIBLINGS) for g in SIBLINGS}}
BASE_TEACHER, BASE_WISHES = {"skip_confirm": 0.3}, 0.5  # the share of proposal drills given a wish (with_wish)


def base_settings(cfg: SFTConfig) -> dict:
    keys = ("seed num_tasks lr warmup_steps grad_clip pretrain_target pretrain_max_steps pretrain_batch_size "
            "base_conversations")
    return {**{k: getattr(cfg, k) for k in keys.split()}, "stores": BASE_STORES, "teacher": BASE_TEACHER,
            "wishes": BASE_WISHES, "width": cfg.tiny_width}


def pretrain_tiny(cfg: SFTConfig, committed: bool = True) -> Path:
    """The 'tiny' base the cold start starts from, as Qwen3 is the paper's: it copies, holds a support conversation
    and knows shop's procedure and its siblings' (same tools, other goods and words) under their old policy: no
    decision, a teacher that never asks (`BASE_STORES`). The paper's regime: its base already does half of tau2
    retail; what the user holds is what it lacks. Two stages, as LLMs are made:

    1. Drills. A model trained from scratch copies a value (an id, a name, an item) only after hundreds of steps of
       dense copying, abruptly, after a plateau; Qwen3 arrives able to. So it trains on drills of the stores'
       conversations (`windows`: the user states values, the agent uses them), items renamed as drawn (`drills`: a
       model copies only tokens it has learned to write), a wish added to those ending in a proposal (`with_wish`),
       at a constant lr until the held-out copy loss (nats per copied value) is below `pretrain_target`.
    2. Conversations: one epoch of SFT on `base_conversations` whole conversations of BASE_STORES (BASE_TEACHER).

    The committed base (COMMITTED_BASE) when the settings are its own and `committed`; else made once and cached under
    MUARL_CACHE, keyed by the settings and the code (`sft.py --pretrain-only` makes one of the settings given)."""
    if cfg.env.split(":")[0] != "shop":
        raise SystemExit(f"--model tiny: the tiny base is pretrained for the 'shop' domain only, not {cfg.env!r} "
                         "(give a cold-start checkpoint: grpo.py --init-from)")
    if cfg.tiny_width % 64:
        raise SystemExit(f"sft.py: --tiny-width {cfg.tiny_width}: give a multiple of 64 (heads of 32, half as many kv)")
    settings = base_settings(cfg)
    made = COMMITTED_BASE / "muarl_config.json"
    if committed and made.exists() and json.loads(made.read_text())["pretrain"]["settings"] == settings:
        return COMMITTED_BASE
    out = models.CACHE_DIR / f"tiny-base-{models.cache_key(settings)}"
    if (out / "config.json").exists():
        return out
    held_out, t0 = 64, time.time()
    per_store = -(-(cfg.num_tasks + held_out) // len(BASE_STORES))
    conversations = [c for store in BASE_STORES for c in make_cold_start(replace(
        cfg, env=store, teacher="expert", user_sim="scripted", teacher_skips_confirm=0.0, teacher_skips_ask=0.0,
        num_tasks=per_store))]
    rng = random.Random(cfg.seed)
    rng.shuffle(conversations)
    train_convs, test_convs = conversations[:-held_out], conversations[-held_out:]
    acc = cli.make_accelerator(mixed_precision="bf16" if cfg.bf16 else "no")
    check_backend(acc)
    models.seed_everything(cfg.seed)
    env = make_env("shop")
    model, tok = models.load_model("tiny", device=acc.device, seed=cfg.seed, dtype=torch.float32, env=env,
                                   tiny_width=cfg.tiny_width)
    test = encode(tok, windows([relabel_goods(c, rng) for c in test_convs]), limit := length_limit(cfg, model))[0]
    copy_ids = {tok.convert_tokens_to_ids(w) for w in env.tokenizer_words()}
    # Constant lr after warm-up: copying appears abruptly after a plateau, and a decaying lr delays it.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, cfg.pretrain_max_steps, floor=1.0))
    model, opt = acc.prepare(model, opt)
    trained = checkpoints.trained_weights(model)  # the drilled stage's checkpoint and the base's, both on this disk
    checkpoints.check_room_to_start(acc, out.parent, (8 * trained, f"two checkpoints of {trained:,} weights at 4 "
                                    "bytes each"), f"sft.py: the tiny base -> {out}: {{room}}. Nothing was trained: "
                                    "make room, or set MUARL_CACHE to a directory on another disk", program="sft.py")
    acc.print(f"[pretrain] tiny: drills from {len(train_convs)} conversations of {', '.join(BASE_STORES)}, renamed as "
              f"drawn, {cfg.pretrain_batch_size} a step, until the copy loss on {len(test)} held-out drills is < "
              f"{cfg.pretrain_target} (at most {cfg.pretrain_max_steps} steps) -> {out}")
    every, step, loss = 25, 0, float("inf")
    while step < cfg.pretrain_max_steps and loss >= cfg.pretrain_target:
        n = min(every, cfg.pretrain_max_steps - step)
        block = encode(tok, drills(train_convs, n * cfg.pretrain_batch_size, rng, BASE_WISHES), limit)[0]
        train_loss = fit(acc, model, opt, sched, block, n, cfg.pretrain_batch_size, cfg.pretrain_batch_size,
                         tok.pad_token_id, cfg.seed * 1_000_003 + step, cfg.grad_clip, "", log_every=0)
        step += n
        model.eval()
        loss, other = copy_loss(acc.unwrap_model(model), tok, test, copy_ids)
        acc.print(f"[pretrain] step {step} train loss {train_loss:.3f} | held-out copy loss {loss:.3f} "
                  f"(chance {math.log(len(copy_ids)):.1f}), other agent tokens {other:.3f} ({time.time() - t0:.0f}s)")
    if loss >= cfg.pretrain_target:
        acc.print(f"[pretrain] stopped at --pretrain-max-steps {cfg.pretrain_max_steps} with copy loss {loss:.3f} "
                  f"above the target {cfg.pretrain_target}: the cold start will copy values badly")
    drilled = out.with_name(out.name + "-drills")
    checkpoints.save_pretrained(acc, model, tok, drilled, {}, program="sft.py")
    del model, opt
    talk = [c for i, (store, part) in enumerate(BASE_STORES.items()) for c in make_cold_start(replace(
        cfg, env=store, teacher="expert", user_sim="scripted", seed=cfg.seed + 1 + i,
        teacher_skips_confirm=BASE_TEACHER["skip_confirm"], teacher_skips_ask=0.0,
        num_tasks=round(cfg.base_conversations * part)))]
    train(replace(cfg, model=str(drilled), out=str(out), epochs=1.0, lora_rank=0), talk, accelerator=acc,
          record={"pretrain": {"settings": settings, "steps": step, "copy_loss": loss, "seconds": time.time() - t0}})
    shutil.rmtree(drilled, ignore_errors=True)
    return out


def main(argv=None):
    cli.cuda_allocator_defaults()  # before CUDA starts: expandable segments, unless the user set the allocator
    cfg = cli.parse_config(SFTConfig, argv, description=__doc__.split("\n\n")[0], program="sft.py")
    check_user_sim(cfg, "sft.py")
    if cfg.pretrain_only or cfg.cold_start_out:
        if cfg.model != "tiny":
            raise SystemExit(f"sft.py: {'--pretrain-only' if cfg.pretrain_only else '--cold-start-out'}: only the "
                             "'tiny' model is made here (--model tiny)")
        if cfg.pretrain_only:  # --base-out: made again (or the cached one)
            made, copy = pretrain_tiny(cfg, committed=not cfg.base_out), ("--base-out", cfg.base_out)
        else:  # made again (or the cached one)
            made = Path(cold_start("tiny", cfg.env, cfg.split, cfg.seed, cfg.bf16, cfg.teacher_skips_confirm,
                                   cfg.teacher_skips_ask, cfg.teacher_skips_status, committed=False))
            copy = ("--cold-start-out", cfg.cold_start_out)
        print(f"[sft] made: {made}")
        if copy[1] and Path(copy[1]).resolve() != made.resolve():
            checkpoints.check_out(copy[1], cfg.overwrite, option=copy[0])
            shutil.rmtree(copy[1], ignore_errors=True)
            shutil.copytree(made, copy[1])
            print(f"[sft] copied to {copy[1]}")
        return
    check_data_options(cfg)  # the teacher's options are not given with --data
    if not cfg.epochs and not cfg.data_out and not cfg.data:
        raise SystemExit("sft.py: --epochs 0 trains nothing: give --data-out to keep the teacher's conversations")
    if cfg.epochs > 0:
        checkpoints.check_out(cfg.out, cfg.overwrite)
        with cli.option_errors("sft.py: --model"):
            models.check_local(cfg.model)
        check_lora(cfg, cli.make_accelerator(cfg.dist_timeout, mixed_precision="bf16" if cfg.bf16 else "no")
                   if cfg.lora_rank else None)  # before any data is made
    if cfg.data_out:
        check_data_out(cfg.data_out, cfg.data, cfg.overwrite)
    if cfg.data:
        try:
            conversations = load_conversations(cfg.data, cfg.strict_data)
        except (ValueError, OSError) as e:
            raise SystemExit(f"sft.py: --data: {e}") from None
    else:
        conversations = teacher_data(cfg)
    if cfg.data_out and int(os.environ.get("RANK", "0")) == 0:  # one writer (every process synthesizes the same)
        disk.write_jsonl_atomic(cfg.data_out, conversations, "sft.py: --data-out")
    if cfg.epochs > 0:
        try:
            train(cfg, conversations)
        except (NothingFits, Untokenizable) as e:
            raise SystemExit(f"sft.py: {e}" if isinstance(e, Untokenizable) else str(e)) from None
    elif not cfg.data_out:  # a check of the file's conversations
        print(f"[sft] --epochs 0: {cfg.data} holds {len(conversations)} conversation(s) to train on; nothing trained")


if __name__ == "__main__":
    main()

"""Cold-start SFT on multi-turn tool-use conversations, and synthesis of the cold-start data.

The paper fine-tunes on ~2,000 multi-turn trajectories before RL. Here the conversations are JSONL lines in
OpenAI format, {"messages": [...], "tools": [...]}, tokenized exactly as the rollout tokenizes an episode
(muarl.encode_conversation) so that SFT and RL train on the same layout and the same loss mask: only the
assistant's tokens (its text, tool calls and end-of-turn token) are trained. An optional "prompt_messages": n
makes the first n messages prompt (a task that continues an earlier conversation: its agent turns are not trained).

    ./run accelerate launch sft.py --data convs.jsonl --model Qwen/Qwen3-8B --out runs/sft-qwen3
    ./run python sft.py --teacher expert --env shop --out runs/coldstart     # make data with the scripted expert
    ./run python sft.py --teacher gpt-4o --env tau2:retail --user-sim openai --data-out retail.jsonl --epochs 0

Cold-start data: a teacher agent (the small domain's scripted expert, or an OpenAI-compatible model) plays
tasks against the environment and a user simulator; episodes with reward 1 are kept.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import muarl


@dataclass
class SFTConfig:
    model: str = "tiny"
    """model to fine-tune: 'tiny', 'smollm2-135m', a local checkpoint directory or a hub id (Qwen/Qwen3-8B)"""
    data: str = ""
    """JSONL conversations ({"messages": [...], "tools": [...]}); empty: synthesize them with --teacher"""
    out: str = "runs/sft"
    """directory the checkpoint is written to (Hugging Face format + tokenizer + this config)"""
    teacher: str = "expert"
    """cold-start teacher when --data is empty: 'expert' (scripted, small domain) or an OpenAI-compatible model"""
    teacher_base_url: str = ""
    """OpenAI-compatible endpoint of the teacher (default: OPENAI_BASE_URL)"""
    env: str = "shop"
    """environment the teacher plays: 'shop' or 'tau2:<domain>'"""
    split: str = "train"
    """task split the teacher plays"""
    num_tasks: int = 1200
    """how many tasks the teacher plays (episodes with reward 1 are kept)"""
    user_sim: str = "scripted"
    """user simulator for the teacher: 'scripted', 'openai', 'hf' (see rollout.py)"""
    user_model: str = "gpt-4o"
    """user simulator model: the endpoint's model name ('openai') or a checkpoint/hub id ('hf')"""
    user_base_url: str = ""
    """OpenAI-compatible endpoint of the user simulator (default: OPENAI_BASE_URL)"""
    user_concurrency: int = 8
    """requests in flight to the user-simulator endpoint"""
    data_out: str = ""
    """also write the synthesized conversations here (JSONL)"""
    epochs: float = 1.0
    """passes over the data (0: only synthesize data)"""
    window_steps: int = -1
    """steps of the short-window stage before whole conversations (see `windows`); -1: 600 for 'tiny', which
    is trained from scratch, 0 for any other model"""
    window_batch_size: int = 32
    """short windows per optimizer step in that stage, over all processes"""
    lr: float = 4e-3
    """peak learning rate (the paper: 5e-6 for Qwen3; a tiny model from scratch needs far more)"""
    warmup_steps: int = 10
    """linear warm-up steps, then cosine decay to 10% of the peak"""
    batch_size: int = 8
    """conversations per optimizer step, over all processes (the paper: 128)"""
    micro_batch_size: int = 4
    """conversations per forward/backward pass on one process"""
    max_len: int = 2048
    """conversations longer than this many tokens are skipped (and counted), never cut"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    bf16: bool = False
    """bf16 mixed precision (GPU)"""
    gradient_checkpointing: bool = False
    """trade compute for memory on long conversations"""
    seed: int = 0
    """seed for data order, initialization of 'tiny' and the teacher's episodes"""


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def load_conversations(path: str) -> list[dict]:
    """Read JSONL conversations; a malformed line stops with the file and line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                msgs = rec["messages"]
                assert isinstance(msgs, list) and msgs, "'messages' must be a non-empty list"
                for m in msgs:
                    assert isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool"), \
                        f"bad message {str(m)[:80]}"
                assert any(m["role"] == "assistant" for m in msgs), "no assistant message to train on"
                tools = rec.get("tools") or []
                assert isinstance(tools, list), "'tools' must be a list"
                n_prompt = rec.get("prompt_messages") or 0
                assert type(n_prompt) is int and 0 <= n_prompt < len(msgs), \
                    "'prompt_messages' must be an int smaller than the number of messages"
                assert any(m["role"] == "assistant" for m in msgs[n_prompt:]), "no assistant message after the prompt"
            except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: malformed conversation: {e!r}") from None
            out.append({"messages": msgs, "tools": tools, "prompt_messages": n_prompt})
    return out


class OpenAIAgent:
    """A teacher agent behind an OpenAI-compatible endpoint, for muarl's envs.play driver."""

    def __init__(self, model: str, tools: list[dict], base_url: str = "", temperature: float = 0.0):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url or None, max_retries=5)
        self.model, self.tools, self.temperature = model, tools, temperature

    def act(self, messages: list[dict]) -> dict:
        r = self.client.chat.completions.create(model=self.model, messages=messages, tools=self.tools or None,
                                                temperature=self.temperature)
        m = r.choices[0].message
        msg = {"role": "assistant", "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        return msg


def make_cold_start(cfg: SFTConfig) -> list[dict]:
    """Play tasks with the teacher and keep the conversations whose reward is 1."""
    from envs import make_env, message_history, play

    env = make_env(cfg.env)
    tasks = env.tasks(cfg.split)
    random.Random(cfg.seed).shuffle(tasks)
    kept, t0 = [], time.time()
    sim = None
    if cfg.user_sim != "scripted":
        from eval import user_sim_options
        from rollout import make_user_sim

        sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    failed = 0
    for task in tasks[:cfg.num_tasks]:
        tools = env.tools(task)
        agent = env.expert(task) if cfg.teacher == "expert" else OpenAIAgent(cfg.teacher, tools, cfg.teacher_base_url)
        session = env.start(task)
        user = sim.sync_user(env, task, session) if sim else None
        try:
            messages, reward, info, termination = play(env, task, agent, user, session=session)
        except Exception as e:  # an endpoint that keeps failing costs this episode only, and is reported
            failed += 1
            print(f"[sft] task {task.id}: episode failed ({e!r}); skipped")
            continue
        if reward == 1.0:  # system + the task's earlier conversation + the user's opening are prompt
            n_prompt = 1 + len(message_history(env, task))
            n_prompt += n_prompt < len(messages) and messages[n_prompt]["role"] == "user"  # the user's opening
            kept.append({"messages": messages, "tools": tools, "task_id": task.id, "prompt_messages": n_prompt})
    print(f"[sft] teacher {cfg.teacher!r} solved {len(kept)}/{min(len(tasks), cfg.num_tasks)} {cfg.env} tasks "
          f"in {time.time() - t0:.1f}s ({failed} failed episodes); keeping the solved ones")
    return kept


def windows(conversations: list[dict], sizes=(1, 2, 4)) -> list[dict]:
    """The short-window stage's data: each agent message that carries arguments (a tool call, or text with a
    digit: "I will cancel order o42") with the last 1, 2 and 4 messages before it, cut to begin at a user
    message, without the system prompt and tools. Only that agent message is trained.

    Why a model trained from scratch needs it: the agent must copy ids, names and items from the dialogue into
    its calls. At initialization attention is spread evenly over the context, so in a ~900-token shop episode
    (two thirds of it the policy and tool schemas) a copy source gets ~1/900 of it, and whole-conversation SFT
    never learns to copy within a CPU budget: held-out id tokens stayed at chance after 600 steps (8% right).
    In ~60-token windows the copy is learned within a few hundred steps and carries over to whole conversations
    (97% of held-out id tokens right after 100 more steps). LLM pretraining also grows the context length over
    training; a pretrained model (Qwen3) already copies and skips this stage."""
    out = []
    for conv in conversations:
        msgs = conv["messages"]
        for i in range(max(1, conv.get("prompt_messages", 0)), len(msgs)):
            m = msgs[i]
            if m["role"] != "assistant" or not (m.get("tool_calls") or any(c.isdigit() for c in str(m.get("content") or ""))):
                continue
            starts = set()
            for w in sizes:
                start = max(1, i - w)
                while start < i and msgs[start]["role"] != "user":
                    start += 1
                if start < i and start not in starts:
                    starts.add(start)
                    out.append({"messages": msgs[start:i + 1], "tools": [], "prompt_messages": i - start})
    return out


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def encode(tok, conversations: list[dict], max_len: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(ids, loss_mask) per conversation, and how many were skipped for being longer than max_len (never cut)."""
    data, skipped = [], 0
    for conv in conversations:
        ids, mask = muarl.encode_conversation(tok, conv["messages"], conv["tools"], conv.get("prompt_messages", 0))
        if len(ids) > max_len:
            skipped += 1
        else:
            data.append((ids, mask))
    return data, skipped


def fit(acc, model, opt, sched, data, steps: int, batch_size: int, micro_batch_size: int, pad_id: int,
        seed: int, grad_clip: float, tag: str) -> None:
    """`steps` optimizer steps of `batch_size` sequences drawn in seeded epochs: token-mean NLL of the masked
    tokens, one normalizer per step over all micro-batches and processes (invariant 3)."""
    from grpo import token_logprobs

    rng, order, t0 = random.Random(seed), [], time.time()
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
            ids, attn, mask = muarl.collate(mb, pad_id, acc.device)
            with acc.no_sync(model) if k < len(micro) - 1 else contextlib.nullcontext():
                logp = token_logprobs(model, ids, attn)
                # DDP averages gradients over processes; scale so the sum over processes is the global mean.
                loss = -(logp * mask).sum() / normalizer * acc.num_processes
                acc.backward(loss)
            total_loss += loss.detach() / acc.num_processes
        grad_norm = acc.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            loss_all = acc.reduce(total_loss, reduction="sum").item()
            acc.print(f"[sft] {tag}step {step + 1}/{steps} loss {loss_all:.4f} grad_norm {float(grad_norm):.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")


def train(cfg: SFTConfig, conversations: list[dict], accelerator=None) -> Path:
    """Fine-tune on the conversations (after the short-window stage, if any); returns the checkpoint directory."""
    acc = accelerator or muarl.make_accelerator(mixed_precision="bf16" if cfg.bf16 else "no")
    muarl.seed_everything(cfg.seed)
    model, tok = muarl.load_model(cfg.model, device=acc.device, seed=cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    data, skipped = encode(tok, conversations, cfg.max_len)
    if not data:
        raise ValueError(f"no conversation fits --max-len {cfg.max_len} ({skipped} skipped)")
    window_steps = cfg.window_steps if cfg.window_steps >= 0 else 600 if cfg.model == "tiny" else 0
    total = max(1, int(cfg.epochs * max(1, len(data) // cfg.batch_size)))
    # The window stage holds its peak lr after warm-up: copying appears abruptly after a plateau (a few hundred
    # steps), and a decaying lr delays it. The conversation stage has its own warm-up and cosine decay.
    first, second = lr_lambda(cfg.warmup_steps, window_steps, floor=1.0), lr_lambda(cfg.warmup_steps, total)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: first(s) if s < window_steps else second(s - window_steps))
    model, opt = acc.prepare(model, opt)
    short = encode(tok, windows(conversations), cfg.max_len)[0] if window_steps else []
    if window_steps and not short:
        acc.print("[sft] short-window stage skipped: no agent message carries arguments (tool calls, digits)")
    if short:
        # As many windows per forward pass as fit in the memory of micro_batch_size whole conversations.
        per_pass = max(1, cfg.micro_batch_size * max(len(i) for i, _ in data) // max(len(i) for i, _ in short))
        acc.print(f"[sft] short-window stage: {len(short)} windows of {sum(len(i) for i, _ in short) / len(short):.0f} "
                  f"tokens on average, {window_steps} steps of {cfg.window_batch_size}")
        fit(acc, model, opt, sched, short, window_steps, cfg.window_batch_size, per_pass, tok.pad_token_id,
            cfg.seed, cfg.grad_clip, "windows ")
        opt.optimizer.state.clear()  # fresh moments for whole conversations: the gradients' scale differs
    acc.print(f"[sft] {len(data)} conversations ({skipped} over --max-len skipped), "
              f"{sum(sum(m) for _, m in data)} trained tokens, {total} steps of {cfg.batch_size}")
    fit(acc, model, opt, sched, data, total, cfg.batch_size, cfg.micro_batch_size, tok.pad_token_id, cfg.seed,
        cfg.grad_clip, "")
    out = Path(cfg.out)
    save_pretrained(acc, model, tok, out, {"sft": asdict(cfg)})
    acc.print(f"[sft] checkpoint written to {out}")
    return out


def save_pretrained(acc, model, tok, out: Path, run_config: dict) -> None:
    """A Hugging Face checkpoint (safetensors + tokenizer + the run config), written atomically."""
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        acc.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tok.save_pretrained(tmp)
        muarl.write_json_atomic(tmp / "muarl_config.json", run_config)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    acc.wait_for_everyone()


def main(argv=None):
    cfg = muarl.parse_config(SFTConfig, argv, description=__doc__.split("\n\n")[0])
    conversations = load_conversations(cfg.data) if cfg.data else make_cold_start(cfg)
    if cfg.data_out:
        Path(cfg.data_out).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.data_out, "w") as f:
            for c in conversations:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
    if cfg.epochs > 0:
        train(cfg, conversations)


if __name__ == "__main__":
    main()

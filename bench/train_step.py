"""The update phase of a GRPO step with and without --share-opening, side by side.

    ./run python bench/train_step.py                 # the default run's episodes, then a tau2-shaped workload
    ./run python bench/train_step.py --rounds 5 --only default

What is timed: grpo.train_on_episodes on the very same episodes (the reference's forward, the policy's forward and
backward, the optimizer step), once with each group's opening computed once (share_opening: per pass over a group's
micro-batches, the reference's once, the policy's once, or twice where the group is split, and its backward once) and
once with every episode whole,
interleaved round by round in one process after a warm-up round (this CPU pages idle memory out and is shared: the
ratio within a round is what to read), at each --micro-batch-sizes (4: grpo.py's default; 1: the paper's recipe).
Printed per workload and size, medians over the rounds: the seconds of each and their ratio; the tokens through the
decoders (policy and reference, padding included, a split group's opening counted each time it is computed; counted by
a hook); the peak memory above the call's start, the optimizer's state made in a call before (on CUDA
torch's peak allocation; on the CPU the resident size sampled every millisecond, in one call of each in a process of
its own where glibc maps large blocks apart, so that freed memory leaves the resident size).

Workloads:
  default  the default run's cold start (grpo.py's own, made and cached if missing, or --agent) and its first step's
           episodes: 4 shop tasks x 8 samples at temperature 0.7, 128 new tokens a turn, 1,536-token context;
           grpo.py's defaults otherwise (AdamW, the reference's KL)
  tau2     tau2 retail's real opening (its policy, tool schemas and a task's first user message, through the tiny
           tokenizer: 7,617 tokens, cut to --tau2-opening) with random remainders, episodes of at most --tau2-length
           tokens (tau2 with Qwen3's tokenizer: a 3-5k opening, 8-15k in all), 2 groups of 8, through the tiny
           model's shape with a context that holds them
  tau2-balanced  the same proportions scaled to a Qwen3-shaped model 512 wide (BALANCED): the opening and episode
           lengths times 512 / 4096, so that attention weighs against the weights as at 8B with tau2's lengths
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from plumbing import cli  # noqa: E402
import grpo  # noqa: E402
from plumbing import models  # noqa: E402
import muarl  # noqa: E402
import toolcall  # noqa: E402
from fast.opening import common_opening  # noqa: E402


def default_workload(agent: str = ""):
    """The default run's cold start (or `agent`) and 4 tasks x 8 episodes of its first step, as grpo.py plays them."""
    import sft
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim
    from envs import make_env

    cfg = grpo.Config()
    start = agent or sft.cold_start("tiny", "shop", "train", cfg.seed, False, cfg.cold_start_skips_confirm,
                                    cfg.cold_start_skips_ask, cfg.cold_start_skips_status)
    model, tok = models.load_model(start, device="cpu")
    env = make_env("shop")
    sampling = RolloutConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                             max_context=cfg.max_context)
    models.seed_everything(0)
    eps = rollout(model, tok, env, env.tasks("train")[:cfg.tasks_per_step], cfg.group_size, make_user_sim("scripted"),
                  sampling, torch.Generator().manual_seed(0))
    return model, tok, eps, cfg


def tau2_workload(length: int, opening_tokens: int, shape: dict | None = None):
    """tau2 retail's opening (cut to `opening_tokens`) through the tiny tokenizer, then random remainders: 2 groups
    of 8 episodes of at most `length` tokens (down to three quarters of it); the tiny model, or Qwen3's architecture
    with the config overrides `shape`."""
    from envs import make_env

    shop = make_env("shop")
    tok = models.load_tokenizer("tiny", shop)
    env = make_env("tau2:retail")
    task = env.tasks("train")[0]
    messages = [{"role": "system", "content": env.system_prompt(task)}, {"role": "user", "content": "Hi, I need help "
                "with an order I placed last week: it has not arrived."}]
    opening = tok(toolcall.render(tok, messages, env.tools(task), add_generation_prompt=True))["input_ids"]
    opening = opening[:opening_tokens]  # tau2 with Qwen3's tokenizer: 3-5k of an 8-15k-token episode
    g, eps = torch.Generator().manual_seed(0), []
    for group in range(2):
        for k in range(8):
            rest = length - len(opening) - int(torch.randint(0, length // 4, (1,), generator=g))
            ids = opening + torch.randint(10, len(tok), (rest,), generator=g).tolist()
            mask = [0] * len(opening) + [int(x) for x in (torch.rand(rest, generator=g) < 0.5)]
            eps.append(muarl.Episode(task_id=f"t{group}", sample=k, input_ids=ids, loss_mask=mask,
                                     logprobs=[-1.0 * m for m in mask], reward=float(k % 2)))
    torch.manual_seed(0)
    config = models.tiny_config(len(tok), max_position_embeddings=max(4096, length + 16), **(shape or {}),
                                **({"arch": "qwen3"} if shape else {}), pad_token_id=tok.pad_token_id,
                                eos_token_id=muarl.end_of_turn_id(tok))
    model = __import__("transformers").AutoModelForCausalLM.from_config(config)
    return model, tok, eps, grpo.Config(max_context=length + 16)


class Peak:
    """Peak memory above the start of a block: torch's peak allocation on CUDA; on the CPU the resident size, sampled
    every millisecond by a thread (it follows the tensors where glibc hands their blocks back: memory_in_a_child)."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        import threading

        self.start = self.peak = self._rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.done.set()
            self.thread.join()
            self.bytes = max(self.peak, self._rss()) - self.start


def count_tokens(*models_):
    """Tokens (padding included) through the models' decoders, counted by a forward hook: [count], removers."""
    count = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        count[0] += ids.numel() if ids is not None else 0
    return count, [m.get_decoder().register_forward_pre_hook(hook, with_kwargs=True) for m in models_]


def update(model, ref, eps, cfg, share: bool, bf16: bool = False) -> tuple[float, int, int]:
    """One train_on_episodes call (an lr so small that the weights barely move: every call sees the same model):
    (seconds, peak bytes above the start, tokens through the decoders); `bf16`: under bf16 autocast. On the CPU the
    memory figure means something only in a process where glibc maps large blocks apart (memory_in_a_child)."""
    cfg = grpo.Config(**{**cfg.__dict__, "share_opening": share, "lr": 1e-12})
    if not hasattr(model, "_bench_optimizer"):  # one optimizer a model: its state is made once, outside the figures
        model._bench_optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    opt = model._bench_optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    acc = cli.make_accelerator()
    count, hooks = count_tokens(model, ref)
    with Peak() as peak:
        t0 = time.perf_counter()
        with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=bf16):
            grpo.train_on_episodes(eps, model, ref, opt, sched, acc, cfg, 0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    return seconds, peak.bytes, count[0]


def memory_in_a_child(name: str, size: int, share: bool, args) -> int:
    """The CPU's peak memory of one update, in a process of its own started with glibc mapping every block of 64 KiB
    or more apart (MALLOC_MMAP_THRESHOLD_, which also stops the threshold from rising): freed tensors then leave the
    resident size, which follows them. In this process that would slow every allocation, and the timing with it."""
    argv = [sys.executable, __file__, "--memory", f"{name}:{size}:{int(share)}", "--agent", args.agent,
            "--tau2-length", str(args.tau2_length), "--tau2-opening", str(args.tau2_opening)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    return int(out.stdout.split()[-1])


# Qwen3-8B's balance of attention to weights at tau2's lengths, scaled down: at ~4.5k tokens of context on average
# attention is ~16% of 8B's FLOPs a token (4 x context x 4096 against ~350M for its projections and MLP); the tiny
# model's 128-wide layers make it ~80% at the same lengths, which a GPU run at 8B never sees. This shape is 512 wide,
# with episodes scaled so that context / width is 8B's at tau2's lengths.
BALANCED = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64)


def load(name: str, args):
    """(model on the device micro-batches go to, tokenizer, episodes, grpo.Config) of a workload."""
    if name == "default":
        model, tok, eps, cfg = default_workload(args.agent)
    elif name == "tau2":
        model, tok, eps, cfg = tau2_workload(args.tau2_length, args.tau2_opening)
    else:
        model, tok, eps, cfg = tau2_workload(args.tau2_length * 512 // 4096, args.tau2_opening * 512 // 4096, BALANCED)
    return model.to(cli.make_accelerator().device), tok, eps, cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (0: the peak memory only)")
    p.add_argument("--only", default="", help="default, tau2 or tau2-balanced (default: all three)")
    p.add_argument("--micro-batch-sizes", default="4,1", help="comma-separated --micro-batch-size values to time")
    p.add_argument("--tau2-length", type=int, default=9000, help="tokens of a tau2-shaped episode (at most)")
    p.add_argument("--tau2-opening", type=int, default=4000, help="tokens of its opening (tau2 retail's, cut)")
    p.add_argument("--agent", default="", help="the default workload's model (default: grpo.py's cold start)")
    p.add_argument("--memory", default="", help=argparse.SUPPRESS)  # in a child: WORKLOAD:SIZE:SHARE
    args = p.parse_args(argv)
    if args.memory:  # memory_in_a_child: one update, its peak bytes
        name, size, share = args.memory.split(":")
        model, tok, eps, base = load(name, args)
        cfg = grpo.Config(**{**base.__dict__, "micro_batch_size": int(size)})
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        update(model.train(), ref, eps, cfg, share == "1")  # the optimizer's state made, as in the timed rounds
        print(update(model, ref, eps, cfg, share == "1")[1])
        return
    for name in [args.only] if args.only else ["default", "tau2", "tau2-balanced"]:
        model, tok, eps, base = load(name, args)
        model.train()
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        lengths = [len(e.input_ids) for e in eps]
        opening = common_opening([(e.input_ids, e.loss_mask) for e in eps[:base.group_size]])
        for size in map(int, args.micro_batch_sizes.split(",")):
            cfg = grpo.Config(**{**base.__dict__, "micro_batch_size": size})
            runs = {True: [], False: []}
            for r in range(args.rounds + 1 if args.rounds else 0):  # round 0 warms up
                for share in (True, False) if r % 2 else (False, True):
                    out = update(model, ref, eps, cfg, share)
                    if r:
                        runs[share].append(out)
            line = f"[train_step] {name}: {len(eps)} episodes of {min(lengths)}-{max(lengths)} tokens (a group's " \
                   f"opening {opening}), groups of {cfg.group_size}, micro-batches of {size}: "
            if args.rounds:
                (a, ma, ta), (b, mb, tb) = ([statistics.median(x) for x in zip(*runs[s])] for s in (False, True))
                line += f"whole {a:.2f} s, shared {b:.2f} s, {a / b:.2f}x faster; decoder tokens {ta:,.0f} whole, " \
                        f"{tb:,.0f} shared ({ta / tb:.2f}x fewer); median of {args.rounds} rounds; "
            if not torch.cuda.is_available():
                ma, mb = (memory_in_a_child(name, size, share, args) for share in (False, True))
            elif not args.rounds:
                ma, mb = (update(model, ref, eps, cfg, share)[1] for share in (False, True))
            print(line + f"peak memory above the start {ma / 2**20:,.0f} MB whole, {mb / 2**20:,.0f} MB shared",
                  flush=True)


if __name__ == "__main__":
    main()

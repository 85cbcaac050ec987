"""metrics.py: what a GRPO run measures, in one place. Every step's metrics go to metrics.jsonl (pipeline.grpo_step).

    METRICS            every name a step logs, with its meaning (the README's metric table is checked against it)
    rollout_metrics    the step's episodes, over all processes: reward, group outcomes, turns, endings, tool calls
    Accumulator        the update's micro-batch metrics (what loss.grpo_loss returns), token-weighted over
                       micro-batches and processes, reduced in one collective with the same names on every process
    console_line       the step's line on the console

A fork that adds a metric returns it from its loss (loss.grpo_loss's metrics dict) or its rollout summary, names
it in METRICS and gives it a kind (TOKEN_MEANS, MAXES, SUMS); Accumulator refuses a metric of no kind, and
tests/test_grpo.py fails when one is missing from METRICS. Imports nothing of the project.
"""
from __future__ import annotations

import torch

# name -> meaning. The kind decides how micro-batches and processes combine it: "token" metrics are means over trained
# tokens (weighted by their count), "max" the largest, "sum" a sum; the others are computed from all episodes at once.
METRICS = {
    "reward_mean": "mean episode reward over all processes (infra-failed episodes left out)",
    "all_correct_ratio": "fraction of task groups whose G episodes all scored 1; such groups have zero advantage",
    "all_wrong_ratio": "fraction of task groups whose G episodes all scored 0; such groups have zero advantage",
    "turns_mean": "agent messages per episode (the paper tracks it)",
    "response_tokens_mean": "tokens the agent sampled per episode (the paper tracks it)",
    "termination/<reason>": "fraction of episodes ending by user_stop, transfer, max_turns, context_limit, "
                            "response_truncated or infra_error; only the first two can score",
    "tool_calls/<name>": "calls per episode by tool; think, calculate and transfer_to_human_agents always present, "
                         "as the paper tracks them",
    "reward_info/<check>": "share of episodes where the reward's yes/no check holds (booleans) or its list is not "
                           "empty: shop's db_match, differ (1 - db_match) and unconfirmed_writes (wrote without a yes)",
    "tool_errors_per_episode": "malformed tool calls, unknown tools, bad arguments and tools that raised, per episode",
    "user_latency_s_mean": "seconds a user reply took, mean over the step's replies (retries included)",
    "user_latency_s_max": "seconds the slowest user reply of the step took",
    "user_retries": "requests to the user simulator's endpoint retried in the step (timeouts, 429, 5xx, bad replies)",
    "infra_failed": "episodes lost to the user simulator or evaluator failing, or to a non-finite reward",
    "episodes": "episodes in the step",
    "dropped_groups": "groups left out of the update by --drop-uniform-groups (all rewards equal)",
    "trained_tokens": "agent-sampled tokens the update trained on, over all processes (the token-mean normalizer)",
    "loss": "the step's GRPO loss (surrogate + KL term), summed over micro-batches and processes, averaged over "
            "updates",
    "kl": "mean k3 estimate of KL(policy || reference) over trained tokens",
    "approx_kl": "mean k3 estimate of KL between the sampling policy and the current one (0 with one update per batch)",
    "clip_frac_low": "fraction of trained tokens whose ratio is clipped below (A < 0)",
    "clip_frac_high": "fraction of trained tokens whose ratio is clipped above (A > 0)",
    "dual_clip_frac": "fraction of trained tokens capped by the dual clip (A < 0, ratio > --dual-clip)",
    "ratio_mean": "importance ratio pi/pi_old over trained tokens (1 with one update per batch)",
    "ratio_max": "largest importance ratio of the step",
    "entropy": "mean entropy of the policy's next-token distribution at trained tokens",
    "logprob_gap": "mean absolute difference between the sampler's and the trainer's log-probabilities of the sampled "
                   "tokens on the same weights: numerical drift between the two paths, should be ~0",
    "grad_norm": "gradient norm before clipping",
    "skipped_updates": "updates dropped because the gradient norm was not finite",
    "lr": "learning rate",
    "rollout_s": "seconds spent rolling out",
    "update_s": "seconds spent updating",
    "gen_tokens_per_s": "sampled tokens per second of rollout",
    "step": "the optimizer step this line is for",
}
TOKEN_MEANS = ("kl", "approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "entropy",
               "logprob_gap")
MAXES = ("ratio_max",)
SUMS = ("loss",)
TRACKED_TOOLS = ("think", "calculate", "transfer_to_human_agents")  # logged even when 0, as the paper tracks them


def documented(name: str) -> bool:
    """Whether a logged name is in METRICS (a family like tool_calls/<name> by its prefix)."""
    return name in METRICS or any(k.endswith(">") and name.startswith(k.split("<")[0]) for k in METRICS)


def reward_checks(info: dict) -> dict:
    """The reward's yes/no checks: booleans as they are, lists as "not empty" (shop's db_match: is the database
    right; unconfirmed_writes: did the agent write without the user's yes)."""
    return {k: bool(v) for k, v in (info or {}).items() if isinstance(v, (bool, list))}


def episode_summary(ep) -> dict:
    """What the step's metrics need of one episode (gathered from every process)."""
    return {"reward": ep.reward, "valid": not ep.infra_failed, "turns": ep.turns, "gen_tokens": ep.gen_tokens,
            "termination": ep.termination, "tool_calls": dict(ep.tool_calls), "tool_errors": ep.tool_errors,
            "task_id": ep.task_id, "checks": reward_checks(ep.reward_info),
            "user_seconds": list(ep.user_seconds), "user_retries": ep.user_retries,
            "error": (ep.reward_info or {}).get("error") if ep.infra_failed else None}


def rollout_metrics(summaries: list[dict], G: int) -> dict:
    """The rollout's metrics over all processes' episodes (`episode_summary`, consecutive groups of G)."""
    n = len(summaries)
    valid = [s for s in summaries if s["valid"]]
    m = {"episodes": n, "infra_failed": n - len(valid)}
    if valid:
        m["reward_mean"] = sum(s["reward"] for s in valid) / len(valid)
        m["turns_mean"] = sum(s["turns"] for s in valid) / len(valid)
        m["response_tokens_mean"] = sum(s["gen_tokens"] for s in valid) / len(valid)
        m["tool_errors_per_episode"] = sum(s["tool_errors"] for s in valid) / len(valid)
    waits = [w for s in summaries for w in s.get("user_seconds", ())]  # failed episodes too: a slow user shows
    m["user_latency_s_mean"] = sum(waits) / len(waits) if waits else 0.0
    m["user_latency_s_max"] = max(waits, default=0.0)
    m["user_retries"] = sum(s.get("user_retries", 0) for s in summaries)
    groups = [summaries[i:i + G] for i in range(0, n, G)]
    rewards = [r for r in ([s["reward"] for s in g if s["valid"]] for g in groups) if r]
    m["all_correct_ratio"] = sum(all(x == 1.0 for x in r) for r in rewards) / max(1, len(rewards))
    m["all_wrong_ratio"] = sum(all(x == 0.0 for x in r) for r in rewards) / max(1, len(rewards))
    for s in summaries:
        key = f"termination/{s['termination']}"
        m[key] = m.get(key, 0) + 1 / n
    for s in valid:
        for name, c in s["tool_calls"].items():
            m[f"tool_calls/{name}"] = m.get(f"tool_calls/{name}", 0) + c / len(valid)
        for name, v in s.get("checks", {}).items():
            m[f"reward_info/{name}"] = m.get(f"reward_info/{name}", 0) + v / len(valid)
    for name in TRACKED_TOOLS:
        m.setdefault(f"tool_calls/{name}", 0.0)
    return m


class Accumulator:
    """The update's metrics over micro-batches and processes: token-weighted means (TOKEN_MEANS), maxima (MAXES),
    sums (SUMS). `reduce` issues one all-reduce per kind with the same names on every process, whatever each one
    saw: a process with nothing to train (every episode failed, every group dropped) still joins with zeros, where a
    metric added only when present would leave the processes waiting on different collectives."""

    def __init__(self):
        self.sums = dict.fromkeys(TOKEN_MEANS + SUMS, 0.0)
        self.weights = dict.fromkeys(TOKEN_MEANS, 0.0)
        self.maxes = dict.fromkeys(MAXES, 0.0)

    def add(self, metrics: dict, tokens: float) -> None:
        """One micro-batch's metrics (0-dim tensors or floats) over its `tokens` trained tokens. A metric of no
        known kind is an error: a fork's new metric needs its name in METRICS and its kind above, or it would be
        lost."""
        for k, v in metrics.items():
            if k == "n_tokens":
                continue
            if not (k in self.weights or k in self.maxes or k in self.sums):
                raise KeyError(f"metric {k!r} has no kind: add it to metrics.METRICS and to TOKEN_MEANS, MAXES or "
                               "SUMS")
            v = float(v)
            if k in self.weights:
                if tokens:
                    self.sums[k] += v * tokens
                    self.weights[k] += tokens
            elif k in self.maxes:
                self.maxes[k] = max(self.maxes[k], v)
            elif k in self.sums:
                self.sums[k] += v

    def reduce(self, acc) -> dict:
        means = torch.tensor([[self.sums[k], self.weights[k]] for k in TOKEN_MEANS], dtype=torch.float64,
                             device=acc.device)
        sums = torch.tensor([self.sums[k] for k in SUMS], dtype=torch.float64, device=acc.device)
        maxes = torch.tensor([self.maxes[k] for k in MAXES], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            means, sums = acc.reduce(means, reduction="sum"), acc.reduce(sums, reduction="sum")
            maxes = acc.reduce(maxes, reduction="max")
        # a mean over no token (nothing trained, no reference for kl) is absent, not a 0 that reads as a measurement
        out = {k: (s / w).item() for k, (s, w) in zip(TOKEN_MEANS, means) if w}
        out.update({k: v.item() for k, v in zip(SUMS, sums)})
        out.update({k: v.item() for k, v in zip(MAXES, maxes)})
        return out


def console_line(m: dict, failed: list[dict], t_roll: float, t_upd: float) -> str:
    """The step's line on the console; episodes lost to infrastructure (the user simulator, the evaluator) are
    counted with the first error, so that a failing endpoint is seen at once, not after the run."""
    line = (f"step {m['step']:4d} | reward {m.get('reward_mean', 0):.3f} "
            f"all-correct {m['all_correct_ratio']:.2f} all-wrong {m['all_wrong_ratio']:.2f} | "
            f"turns {m.get('turns_mean', 0):.1f} resp-tok {m.get('response_tokens_mean', 0):.0f} | "
            f"loss {m['loss']:+.4f} kl {m.get('kl', 0):.4f} "
            f"clip {m.get('clip_frac_low', 0) + m.get('clip_frac_high', 0):.3f} "
            f"ent {m.get('entropy', 0):.2f} gnorm {m.get('grad_norm', 0):.2f} | {t_roll:.1f}s+{t_upd:.1f}s")
    if m.get("dropped_groups"):
        line += f" | {m['dropped_groups']} uniform groups dropped"
    if m.get("user_latency_s_max", 0) >= 1 or m.get("user_retries"):  # a slow or flaky user endpoint shows here
        line += (f" | user {m['user_latency_s_mean']:.1f}s mean, {m['user_latency_s_max']:.1f}s max, "
                 f"{m['user_retries']} retries")
    if failed:
        line += (f"\n     | {len(failed)} of {m['episodes']} episodes failed on infrastructure, left out; "
                 f"first: {failed[0]['error']}")
    return line

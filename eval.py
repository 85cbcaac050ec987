"""Evaluate an agent on an environment split with k trials per task: pass^1 (mean reward), pass^k, per-task
results, termination reasons, turns. Writes episodes.jsonl, summary.json and results.md to --out-dir.

    ./run python eval.py --agent runs/grpo-shop-.../checkpoints/step-000040/model --env shop --split test
    ./run accelerate launch eval.py --agent Qwen/Qwen3-8B --env tau2:retail --user-sim openai --user-model gpt-4.1 \
          --trials 4
    ./run python eval.py --agent openai:gpt-4o --env tau2:airline --user-sim openai     # an API model as the agent
    ./run python eval.py --agent openai:gpt-4o --env bfcl:multi_turn --max-turns 100    # BFCL-V3 multi-turn
    ./run python eval.py --agent openai:gpt-4o --env acebench:agent --acebench-root ACEBench --user-sim openai
    ./run python eval.py --plot runs/grpo-shop-...                                      # a run's learning curves
    ./run python eval.py --show runs/grpo-shop-.../episodes.jsonl --show-index 3      # an episode, tokens marked

The agent is a checkpoint directory, a hub id, 'smollm2-135m', 'openai:<model>' for an OpenAI-compatible
model (baselines), or 'expert' for the environment's scripted expert (shop; BFCL's ground truth), which checks the
pipeline. tau2 environments score with tau2's own reward (envs/tau2.py), BFCL with its checker (envs/bfcl.py).
Where tasks carry a category (BFCL's four, ACEBench's two), the summary adds pass^1 per category and their
unweighted mean (`category_mean`), the benchmark's headline.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from plumbing import cli, disk, lora, memory, metrics, models, shard
from plumbing.stats import summarize
from fast.deadlines import guard, prepare
import muarl
from plumbing.cli import SEEDS, TIMEOUTS, Range
from plumbing.options import AttentionOptions, SamplingOptions, UserOptions
from plumbing.users import check_user_sim, user_sim_options


@dataclass
class Evaluation:
    """evaluation: the agent, the tasks, the output"""
    agent: str = ""
    """checkpoint directory, hub id, 'smollm2-135m', 'openai:<model>' (OpenAI-compatible endpoint), or 'expert'
    (the environment's scripted expert)"""
    agent_base_url: str = ""
    """endpoint for an 'openai:' agent (default: OPENAI_BASE_URL)"""
    agent_timeout: Annotated[float, TIMEOUTS] = 600.0
    """seconds an 'openai:' agent's request may wait for each read, retried 3 times (then the episode fails)"""
    env: str = "shop"
    """environment: 'shop', 'tau2:<retail|airline|telecom|mock>', 'bfcl:<multi_turn|multi_turn_base|...>',
    'acebench:agent'"""
    acebench_root: str = ""
    """acebench only: the ACEBench checkout (default: ACEBENCH_ROOT)"""
    split: str = "test"
    """task split"""
    env_reward: str = ""
    """tau2 only: 'db' for the database check only; '' for tau2's full reward (what tau2 reports)"""
    num_tasks: Annotated[int, Range("[0, inf)")] = 0
    """evaluate the first N tasks of the split (0: all)"""
    trials: Annotated[int, Range("[1, inf)")] = 1
    """trials per task, k (pass^k needs k >= 2)"""
    seed: Annotated[int, SEEDS] = 0
    """sampling seed"""
    out_dir: str = ""
    """output directory (default: runs/eval-<env>-<time>)"""
    memory_check: bool = True
    """on a GPU, stop at start when the estimated memory (weights and the decoding episodes' KV cache at
    --max-context, printed) exceeds it"""
    dist_timeout: Annotated[float, TIMEOUTS] = 7200.0
    """seconds a process waits for the others (they finish their episodes at different times) before it stops"""
    compare: tuple[str, ...] = ()
    """two evaluation directories (--out-dir of two runs of eval.py on the same tasks): agent A minus agent B,
    paired over the shared tasks, with 95% intervals, for all tasks and for each task group (--compare A B)"""
    plot: str = ""
    """draw a grpo.py run directory's learning curves (RUN_DIR/curves.png, from its metrics.jsonl) and exit"""
    show: str = ""
    """print one logged episode of a JSONL file (a run's episodes.jsonl or eval-*.jsonl, an evaluation's
    episodes.jsonl) as its recorded token ids, the tokens it trains on marked, and exit; --agent names the tokenizer
    where the file's directory does not"""
    show_index: Annotated[int, Range("[0, inf)")] = 0
    """which episode of the --show file (its line, from 0)"""
    merge_lora: str = ""
    """write the --agent adapter checkpoint (--lora-rank) merged into its base to this directory (a full model with
    its tokenizer, for serving or another start) and exit"""
    merge_dtype: str = ""
    """dtype of the merged weights: '' the base model's own (bf16 for Qwen3: each merged weight rounded once), or
    float32, bfloat16, float16"""


@dataclass
class EvalConfig(AttentionOptions, UserOptions, SamplingOptions, Evaluation):
    """Evaluate an agent: pass^1 and pass^k over --trials per task."""
    temperature: Annotated[float, Range("[0, inf)")] = 0.0
    """agent sampling temperature (0: greedy)"""
    user_model: str = "gpt-4.1"
    """user simulator model (the paper evaluates with GPT-4.1)"""


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _ci(ci) -> str:
    return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def pass_keys(s: dict) -> list[str]:
    return [k for k in s if k.startswith("pass^") and not k.endswith("_ci95")]


def markdown(cfg: EvalConfig, s: dict) -> str:
    ks = pass_keys(s)
    lines = [f"# {cfg.agent} on {cfg.env}:{cfg.split}", "",
             "| tasks | trials | " + " | ".join(ks) + " | avg turns | infra failed |",
             "|---|---|" + "---|" * len(ks) + "---|---|",
             f"| {s['tasks']} | {cfg.trials} | " + " | ".join(_num(s[k]) + _ci(s.get(k + "_ci95")) for k in ks) +
             f" | {s['avg_turns']:.1f} | {s['infra_failed']} |", "",
             "pass^1's 95% interval: bootstrap over tasks (stats.py).", "", "Termination: " +
             ", ".join(f"{k} {v}" for k, v in sorted(s["termination"].items())), "",
             "| task | successes / trials | mean reward |", "|---|---|---|"]
    if s.get("rates"):
        lines[-2:-2] = ["Rates over the scored episodes that record them: " + ", ".join(
            f"{k} {r['rate']:.3f} ({r['episodes']})" for k, r in s["rates"].items()), ""]
    for k, vs in s.get("by_meta", {}).items():
        if k == "category" and "category_mean" in s:
            continue  # a table of its own, below
        lines[-2:-2] = [f"pass^1 by {k}: " + ", ".join(f"{v} {r['pass^1']:.3f}{_ci(r.get('ci95'))} ({r['episodes']})"
                                                      for v, r in vs.items()), ""]
    if "category_mean" in s:
        rows = ["| category | pass^1 | episodes |", "|---|---|---|"] + [
            f"| {c} | {r['pass^1']:.3f} | {r['episodes']} |" for c, r in s["by_meta"]["category"].items()]
        lines[-2:-2] = rows + [f"| **mean over categories** | **{s['category_mean']:.3f}** | |", ""]
    lines += [f"| {t} | {r['successes']} / {r['trials']} | {r['mean_reward']:.2f} |" for t, r in s["per_task"].items()]
    return "\n".join(lines) + "\n"


class _ToolsAt:
    """An API agent whose tool list follows the conversation (env.tools_at: BFCL miss_func reveals tools later)."""

    def __init__(self, agent, env, task):
        self.agent, self.env, self.task = agent, env, task

    def act(self, messages: list[dict]) -> dict:
        self.agent.tools = self.env.tools_at(self.task, messages)
        return self.agent.act(messages)


def run_api_agent(cfg: EvalConfig, env, tasks) -> list[dict]:
    """An OpenAI-compatible model (or the env's scripted expert) as the agent, through the text-level driver (no
    token-level record)."""
    from envs import Termination, message_history, play
    from envs.api_agent import DEAD_AFTER, OpenAIAgent
    from plumbing.users import make_user_sim

    sim = None
    if cfg.user_sim != "scripted":
        sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    out = []
    for task in tasks:
        for trial in range(cfg.trials):
            if cfg.agent == "expert":
                agent = env.expert(task)
            else:
                agent = OpenAIAgent(cfg.agent.split(":", 1)[1], env.tools(task), cfg.agent_base_url, cfg.temperature,
                                    timeout=cfg.agent_timeout)
                agent = _ToolsAt(agent, env, task) if hasattr(env, "tools_at") else agent
            session = guard(env, task, cfg.tool_timeout, remote=getattr(env, "slow_tools", False))
            try:
                messages, reward, info, termination = play(env, task, agent,
                                                           sim.sync_user(env, task, session) if sim else None,
                                                           max_turns=cfg.max_turns, session=session)
                failed = termination == Termination.INFRA_ERROR  # the evaluator failed (envs.score)
            except Exception as e:  # the endpoint failed after its retries: report, don't score
                messages, reward, info, termination, failed = [], 0.0, {"error": str(e)}, Termination.INFRA_ERROR, True
                if len(out) + 1 >= DEAD_AFTER and all(ep["infra_failed"] for ep in out):  # nothing ever worked
                    raise SystemExit(f"eval.py: the first {len(out) + 1} episodes all failed; stopping rather than "
                                     f"playing the other {len(tasks) * cfg.trials - len(out) - 1}. The last failure: "
                                     f"{e}") from None
            new = messages[1 + len(message_history(env, task)):]  # the task's earlier conversation is not this agent's
            ep = muarl.Episode(task_id=task.id, sample=trial, messages=messages, reward=reward, reward_info=info,
                               termination=termination, infra_failed=failed,
                               turns=sum(m["role"] == "assistant" for m in new))
            for m in new:
                for c in m.get("tool_calls") or []:
                    ep.tool_calls[c["function"]["name"]] += 1
            out.append(ep.to_json())
    return out


def merge_adapters(agent: str, out: str, dtype: str = "") -> Path:
    """An adapter checkpoint folded into its base (W + scale x B A, in fp32), saved as a full model with the tokenizer
    in `dtype` ('': the dtype the base model's config declares, fp32 when it declares none); `out` is refused when
    it holds anything (nothing is overwritten)."""
    import torch

    from plumbing import checkpoints

    if agent.startswith("openai:") or agent == "expert":
        raise SystemExit(f"eval.py: --merge-lora: --agent {agent} is not a checkpoint; --merge-lora folds the adapters "
                         "of an adapter checkpoint into its base")
    if not lora.is_adapter_dir(agent):
        raise SystemExit(f"eval.py: --merge-lora: --agent {agent} is not an adapter checkpoint (no "
                         f"{lora.ADAPTER_CONFIG}); it is a full model already")
    if dtype not in ("", "float32", "bfloat16", "float16"):
        raise SystemExit(f"eval.py: --merge-dtype: {dtype!r} is not float32, bfloat16 or float16 ('': the base's)")
    checkpoints.check_out(out, overwrite=None, program="eval.py", option="--merge-lora")
    base_config = memory.read_config(lora.base_chain(agent)[-1])
    dtype = dtype or str(getattr(base_config, "dtype", None) or "float32").removeprefix("torch.")
    model, tok = models.load_model(agent, device="cpu", dtype=torch.float32)
    merged = lora.merge(model).to(getattr(torch, dtype if dtype in ("bfloat16", "float16") else "float32"))
    print(f"[eval] merged in fp32, saved in {merged.dtype}"
          + (" (each weight rounded once)" if merged.dtype != torch.float32 else ""))
    checkpoints.save_pretrained(cli.make_accelerator(), merged, tok, Path(out),
                                {"merged": {"adapters": str(Path(agent).resolve()), "base": lora.base_of(agent)}})
    return Path(out)


WRITES = ("episodes.jsonl", "summary.json", "results.md")


def check_out_dir(out: Path) -> None:
    """Refuse an --out-dir whose files this evaluation would replace and no evaluation wrote: a training run's, or
    anything holding a file of WRITES beside no summary.json of an earlier evaluation (which names its --agent), and
    a place it cannot write into (read-only, below a file), before the evaluation rather than after."""
    disk.check_writable(out, "eval.py", "--out-dir")
    from plumbing.checkpoints import holds_model

    if holds_model(out):
        raise SystemExit(f"eval.py: --out-dir: {out} holds a model (config.json and its weights), beside which this "
                         f"evaluation's files do not belong; give it a directory of its own, e.g. --out-dir "
                         f"{out / 'eval'}")
    if any((out / name).exists() for name in ("config.json", "checkpoints")):
        raise SystemExit(f"eval.py: --out-dir: {out} holds a training run (config.json, checkpoints/), whose "
                         "episodes.jsonl and summary.json this evaluation would replace; give it a directory of its "
                         f"own, e.g. --out-dir {out / 'eval'}")
    theirs = [name for name in WRITES if (out / name).exists()]
    try:
        earlier = "agent" in json.loads((out / "summary.json").read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        earlier = False
    if theirs and not earlier:
        raise SystemExit(f"eval.py: --out-dir: {out} holds {', '.join(theirs)}, which no evaluation wrote (no "
                         "summary.json of one beside them) and this one would replace; give it another directory")


def main(argv=None):
    cli.cuda_allocator_defaults()  # before CUDA starts: expandable segments, unless the user set the allocator
    import torch
    from accelerate.utils import gather_object

    from envs import load_tasks

    cfg = cli.parse_config(EvalConfig, argv, description=__doc__.split("\n\n")[0], program="eval.py")
    check_user_sim(cfg, "eval.py")
    if cfg.plot:
        print(f"[eval] learning curves written to {metrics.plot_run(cfg.plot)}")
        return
    if cfg.show:
        from plumbing import show

        print(show.show(cfg.show, cfg.show_index, cfg.agent), end="")
        return
    if cfg.compare:
        if len(cfg.compare) != 2:
            raise SystemExit(f"eval.py: --compare takes two evaluation directories, A and B; got {len(cfg.compare)}")
        print(metrics.compare(*cfg.compare), end="")
        return
    if not cfg.agent:
        raise SystemExit("eval.py: --agent is required (a checkpoint directory, hub id, smollm2-135m or "
                         "openai:<model>)")
    if cfg.merge_dtype and not cfg.merge_lora:
        raise SystemExit("eval.py: --merge-dtype: has no effect without --merge-lora OUT")
    if cfg.merge_lora:
        idle = [f"--{f.replace('_', '-')}" for f in ("env", "split", "num_tasks", "trials", "temperature", "out_dir",
                                                     "user_sim") if getattr(cfg, f) != getattr(EvalConfig, f)]
        if idle:
            raise SystemExit(f"eval.py: --merge-lora: {', '.join(idle)} has no effect: --merge-lora writes the merged "
                             "model and exits; evaluate it with eval.py --agent <its directory>")
        print(f"[eval] {cfg.agent} merged into its base: {merge_adapters(cfg.agent, cfg.merge_lora, cfg.merge_dtype)}")
        return
    if cfg.out_dir:
        check_out_dir(Path(cfg.out_dir))
    options = {"reward": cfg.env_reward} if cfg.env_reward else {}
    if cfg.env.startswith("acebench:") and cfg.acebench_root:
        options["root"] = cfg.acebench_root
    env, tasks = load_tasks(cfg.env, cfg.split, "eval.py", **options)
    if cfg.agent == "expert" and not callable(getattr(env, "expert", None)):
        raise SystemExit(f"eval.py: --agent expert: {cfg.env} has no scripted expert (shop and bfcl: have one)")
    if cfg.agent == "tiny":  # a model made here from random weights: its score says nothing of anything trained
        raise SystemExit("eval.py: --agent tiny: the tiny model untrained (random weights); give a checkpoint of it: "
                         "assets/tiny-base, a run's checkpoints/step-N/model, or sft.py's --out")
    tasks = tasks[:cfg.num_tasks] if cfg.num_tasks else tasks
    if cfg.tool_timeout:
        prepare(env)  # the keeper of the tool calls' probes, forked while this process is small (deadlines.py)
    acc = cli.make_accelerator(cfg.dist_timeout)
    t0 = time.time()
    if cfg.agent.startswith("openai:") or cfg.agent == "expert":
        episodes = run_api_agent(cfg, env, tasks[acc.process_index::acc.num_processes])
    else:
        from fast.batched_rollout import RolloutConfig, parse_slots, rollout
        from plumbing.options import check_max_context

        from plumbing.users import make_user_sim

        early = None  # the tokenizer alone first: a --max-context no episode can start in stops before the weights
        with contextlib.suppress(SystemExit):  # load (an agent that does not load is named below, with its option)
            early = models.start_tokenizer(cfg.agent) if cfg.agent != "tiny" else None
        if early is not None:
            check_max_context(early, env, tasks, cfg.max_context, "eval.py")

        mine = tasks[acc.process_index::acc.num_processes]
        live = len(mine) * cfg.trials
        decoding = min(live, cfg.rollout_batch or live)
        try:  # the rollout's options (a malformed --decode-slots among them) stop now, not once the model has loaded
            RolloutConfig.from_options(cfg, on_gpu=acc.device.type != "cpu")
        except SystemExit as e:
            raise SystemExit(f"eval.py: {e}") from None
        sizes = parse_slots(cfg.decode_slots, cfg.max_context) if cfg.decode_slots else []
        decoding = min(decoding, sum(n for n, _ in sizes) or decoding)  # slots sized by need hold what they list
        bf16 = models.default_dtype(acc.device) == torch.bfloat16  # load_model's default: bf16 on GPU, fp32 on CPU
        attn = models.attention_implementation(acc.device, None, cfg.attn, "eval.py")  # None: load_model's dtype
        with cli.option_errors("eval.py: --agent"):
            models.check_local(cfg.agent)
            config = memory.read_config(lora.base_chain(cfg.agent)[-1])  # adapters: the model at the chain's root
            on_gpu = acc.device.type == "cuda"
            room = (torch.cuda.get_device_properties(acc.device).total_memory if on_gpu else
                    memory.cpu_room() if acc.device.type == "cpu" else 0)
            if config is not None and not cfg.rollout_batch and room and cfg.memory_check and not sizes:
                # --rollout-batch 0: as many as the GPU (or the CPU's free host memory) holds decode at once, the
                # others wait (on a GPU, in host memory)
                decoding = memory.fitting_batch(config, live=live, bf16=bf16, max_context=cfg.max_context,
                                                device_bytes=room, prefill_tokens=RolloutConfig.prefill_tokens)
                cfg.rollout_batch = decoding if decoding < live else 0
                if on_gpu or decoding < live:
                    acc.print(f"[eval] --rollout-batch 0: {decoding} of this process's {live} episodes decode at "
                              f"once, as many as {'this GPU holds' if on_gpu else 'the free host memory holds'} by "
                              "the estimate (the others wait" + (" in host memory)" if on_gpu else ")"))
            if config is not None:  # before loading: weights and the decoding episodes' KV cache
                memory.check_memory(config, world=acc.num_processes, sharded=False, bf16=bf16, reference=False,
                                   max_context=cfg.max_context, episodes=decoding, device=acc.device,
                                   check=cfg.memory_check, program="eval.py", inference=True,
                                   parked=live - decoding if acc.device.type != "cpu" else 0,
                                   prefill_tokens=RolloutConfig.prefill_tokens,
                                   slot_positions=sum(n * cap for n, cap in sizes))
            with cli.outside_zero3_init():  # evaluated only: never partitioned under a ZeRO-3 config
                model, tok = models.load_model(cfg.agent, device=acc.device, env=env, attn_implementation=attn)
        shard.check_same_weights(acc, model, f"--agent {cfg.agent}", "eval.py")  # each process loaded its own copy
        if early is None:
            check_max_context(tok, env, tasks, cfg.max_context, "eval.py")
        model.eval()
        user_sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
        if cfg.user_sim == "hf":  # each process loaded its own copy of the user: the same one?
            shard.check_same_weights(acc, user_sim.sim.model, f"--user-model {cfg.user_model}", "eval.py")
        sampling = RolloutConfig.from_options(cfg, on_gpu=acc.device.type != "cpu")
        gen = torch.Generator(acc.device).manual_seed(cfg.seed * 1_000_003 + acc.process_index)
        eps = rollout(model, tok, env, mine, cfg.trials, user_sim, sampling, gen)
        episodes = [e.to_json(tokens=True) for e in eps]  # with the ids and loss mask: eval.py --show prints one
    episodes = gather_object(episodes)
    if acc.is_main_process:
        out = Path(cfg.out_dir or f"runs/eval-{cfg.env.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}")
        disk.write_jsonl_atomic(out / "episodes.jsonl", episodes, "eval.py: --out-dir")
        s = summarize(episodes, cfg.trials, {t.id: t.meta for t in tasks})
        s["config"], s["seconds"] = asdict(cfg), time.time() - t0
        try:
            disk.write_json_atomic(out / "summary.json", s)
            (out / "results.md").write_text(markdown(cfg, s))
        except OSError as e:  # a full disk: no summary (a stale one neither) beside episodes.jsonl, which is whole
            for name in ("summary.json", "results.md"):
                with contextlib.suppress(OSError):
                    (out / name).unlink(missing_ok=True)
            raise SystemExit(f"eval.py: --out-dir: cannot write {out}'s summary: {e.strerror or e} (is the disk full "
                             "or read-only?); its episodes.jsonl is whole (eval.py --show reads it). Make room, then "
                             "evaluate again into another --out-dir") from None
        ks = " ".join(f"{k} {_num(s[k])}{_ci(s.get(k + '_ci95'))}" for k in pass_keys(s) + (
            ["category_mean"] if "category_mean" in s else []))
        print(f"[eval] {cfg.agent} on {cfg.env}:{cfg.split}: {s['tasks']} tasks x {cfg.trials}: {ks}, "
              f"avg turns {s['avg_turns']:.1f}, infra failed {s['infra_failed']}. Written to {out}")
        if not s["scored"]:
            first = next((e["reward_info"].get("error") for e in episodes if e.get("reward_info")), None)
            raise SystemExit(f"eval.py: none of the {len(episodes)} episodes was scored: all failed on infrastructure "
                             "(an endpoint the agent or the user simulator calls, or the evaluator); the first error: "
                             f"{first}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # (it was a traceback) an evaluation is written whole, or not at all
        print("\n[eval] stopped by Ctrl-C: nothing was written (an evaluation's files are written whole)", flush=True)
        raise SystemExit(130) from None

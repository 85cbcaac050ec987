"""The paper's ablation in miniature: does GRPO against a dynamic simulated user beat more imitation, GRPO against
a static user, and GRPO without a cold start, on held-out tasks with the dynamic user?

    ./run python bench/ablation.py               # 5 arms x 3 seeds on the shop domain (~80 min on 2 CPU cores)
    ./run python bench/ablation.py --quick       # 1 seed, a few steps and tasks: a smoke test, not a result

MUA-RL's ablation (TAU2 Retail, Qwen3-32B): base 50.2, cold start 58.2, RL only 61.6, cold start + RL 67.3. Here,
from the same pretrained `tiny` base (sft.pretrain_tiny, made once and cached), for each seed:

  1 cold start       SFT on the scripted teacher's conversations (the default run's imperfect teacher: it writes
                     without asking in --skips of them, the database filter keeps those), --cold-static of them with
                     shop:static's user: a cold start that never saw a static opening answered it with garbled tool
                     calls, and GRPO with the static user then had only all-wrong groups for 25 steps (bench/README.md)
  2 + more SFT       a second SFT run from arm 1 (sft.py's recipe: warm-up to its peak lr again, cosine decay) on a
                     new shuffle of the training tasks (about a quarter of them are the cold start's, whose
                     conversations are the same), for as many seconds as arm 3's GRPO took
  3 + GRPO           GRPO with the dynamic scripted user (shop): vague opening, details when asked, changes of mind
  4 + GRPO static    GRPO with shop:static's user: identity and final request in its opening, never changes its mind
  5 GRPO only        GRPO from the base, no cold start

Arms 3-5 share the seed, hence the training tasks and their order; every arm is evaluated against the *dynamic* user
on the same first --eval-tasks test tasks: greedy pass^1, and pass^k from --trials episodes a task sampled at
--temperature (GRPO's default, at which arms 3-5 train; the scripted user is deterministic, so greedy trials would all
be the same). The seed also picks the cold start's conversations and initial order, so the spread over seeds includes
the cold start's; the tiny base's drills come from seed 0's shuffle of the training tasks (sft.pretrain_tiny), so
seed 0's cold start plays the tasks the base drilled on. The spread is over seeds on one fixed set of test tasks: it
does not include the test set's own sampling error (one task is 1/--eval-tasks).

Writes to --out: results.md (the table, and each seed's paired differences), results.json, ablation.png (test pass^1
against seconds of training after the cold start: seeds thin, mean thick) and dynamics.png (per GRPO step: reward, turns, response tokens,
all-correct / all-wrong groups, transfers to a human, writes without the user's yes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import coldstart  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import sft  # noqa: E402
from batched_rollout import RolloutConfig, make_user_sim, rollout  # noqa: E402
from envs import make_env  # noqa: E402
from eval import pass_hat_k  # noqa: E402

ARMS = {1: "cold start", 2: "+ more SFT", 3: "+ GRPO, dynamic user", 4: "+ GRPO, static user",
        5: "GRPO, no cold start"}
COLORS = {1: (127, 127, 127), 2: (31, 119, 180), 3: (214, 39, 40), 4: (255, 127, 14), 5: (44, 160, 44)}
CAPS = dict(max_turns=30, max_new_tokens=128, max_context=1536)  # the default run's (grpo.Config)


def evaluate(path, tasks, trials: int, temperature: float, seed: int) -> dict:
    """Greedy pass^1, and (trials > 0) pass^1 and pass^k of `trials` sampled episodes per task, against the dynamic
    user; plus how the sampled episodes behave (writes without a yes, transfers, turns)."""
    model, tok = models.load_model(str(path), device="cpu", dtype=torch.float32)
    env, sim = make_env("shop"), make_user_sim("scripted")
    t0 = time.time()
    greedy = rollout(model, tok, env, tasks, 1, sim, RolloutConfig(greedy=True, **CAPS))
    res = {"greedy_pass1": sum(e.reward == 1.0 for e in greedy) / len(greedy)}
    if trials:  # 0: greedy only (the intermediate checkpoints)
        gen = torch.Generator().manual_seed(seed)
        eps = rollout(model, tok, env, tasks, trials, sim, RolloutConfig(temperature=temperature, **CAPS), gen)
        wins = [sum(e.reward == 1.0 for e in eps[i * trials:(i + 1) * trials]) for i in range(len(tasks))]
        res.update({"sampled_pass1": sum(wins) / len(eps),
                    f"pass{trials}": sum(pass_hat_k(w, trials, trials) for w in wins) / len(tasks),
                    "unasked": sum(bool(e.reward_info.get("unconfirmed_writes")) for e in eps) / len(eps),
                    "transfers": sum(e.tool_calls.get("transfer_to_human_agents", 0) for e in eps) / len(eps),
                    "turns": sum(e.turns for e in eps) / len(eps)})
    res["eval_s"] = time.time() - t0
    return res


def teacher_conversations(n_dynamic: int, n_static: int, seed: int, skips: float) -> list[dict]:
    """The scripted teacher's conversations with the dynamic user and with the static one (two shuffles of the
    training tasks: some tasks are played with both users, different conversations)."""
    convs = []
    for env, n, s in (("shop", n_dynamic, seed), ("shop:static", n_static, seed + 7919)):
        if n:
            convs += coldstart.make_cold_start(sft.SFTConfig(env=env, num_tasks=n, seed=s, teacher_skips_confirm=skips))
    return convs


def grpo_arm(start: list[str], env: str, out: Path, args, seed: int) -> tuple[float, list[tuple[int, Path]]]:
    """A GRPO run; returns its seconds and its checkpoints (step, model directory)."""
    t0 = time.time()  # --overwrite: a rerun replaces the arm's earlier run (grpo.py refuses it otherwise)
    grpo.main([*start, "--overwrite", "--env", env, "--steps", str(args.steps), "--seed", str(seed), "--eval-tasks", "0",
               "--tasks-per-step", str(args.tasks_per_step), "--group-size", str(args.group_size),
               "--temperature", str(args.temperature),
               "--save-every", str(-(-args.steps // args.points)), "--save-weights-only", "--log-episodes", "0",
               "--out-dir", str(out)])
    seconds = time.time() - t0
    ckpts = sorted((int(p.name.split("-")[1]), p / "model") for p in (out / "checkpoints").glob("step-*")
                   if not p.name.endswith(".tmp"))
    return seconds, ckpts


def run_seed(seed: int, base: str, tasks, args, out: Path, log) -> dict:
    """All five arms for one seed: {arm: {"curve": [(seconds, greedy pass^1)], "final": evaluate(...), ...}}."""
    d = out / f"seed{seed}"
    arms: dict[int, dict] = {}

    def final(arm: int, path, seconds: float, curve: list) -> None:
        res = evaluate(path, tasks, args.trials, args.temperature, seed)
        arms[arm] = {"seconds": seconds, "curve": curve + [(seconds, res["greedy_pass1"])], "final": res}
        log(f"seed {seed} arm {arm} ({ARMS[arm]}): {fmt(res, args.trials)} after {seconds:.0f}s of training")

    def curve_of(run: Path, seconds: float, ckpts, start_score: float | None) -> list:
        """Greedy pass^1 at the intermediate checkpoints, placed at their share of the run's step time."""
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        step_s = [r["rollout_s"] + r["update_s"] for r in rows]
        pts = [] if start_score is None else [(0.0, start_score)]
        for step, path in ckpts[:-1]:
            pts.append((seconds * sum(step_s[:step]) / sum(step_s), evaluate(path, tasks, 0, 0, seed)["greedy_pass1"]))
        return pts

    # 1: the cold start (its data and SFT are not counted in any arm's seconds: every arm but 5 starts there)
    t0 = time.time()
    convs = teacher_conversations(args.cold_dynamic, args.cold_static, seed, args.skips)
    t1 = time.time()
    cold = sft.train(sft.SFTConfig(model=base, out=str(d / "cold_start"), seed=seed), convs)
    sft_s, sft_steps = time.time() - t1, max(1, len(convs) // sft.SFTConfig.batch_size)
    log(f"seed {seed} cold start: {len(convs)} conversations ({t1 - t0:.0f}s to play), SFT {sft_steps} steps in {sft_s:.0f}s")
    final(1, cold, 0.0, [])
    arms[1]["cold_start_s"] = time.time() - t0 - arms[1]["final"]["eval_s"]
    cold_score = arms[1]["final"]["greedy_pass1"]

    # 3 and 4: GRPO from the cold start, dynamic and static user
    for arm, env in ((3, "shop"), (4, "shop:static")):
        run = d / f"arm{arm}"
        seconds, ckpts = grpo_arm(["--init-from", str(cold)], env, run, args, seed)
        final(arm, ckpts[-1][1], seconds, curve_of(run, seconds, ckpts, cold_score))

    # 2: more SFT of the same teacher, for arm 3's seconds (its conversations' playing time included)
    t0 = time.time()
    more = teacher_conversations(args.cold_dynamic, args.cold_static, seed + 100, args.skips)
    budget = arms[3]["seconds"] - (time.time() - t0)
    steps = max(1, int(budget / (sft_s / sft_steps)))
    epochs = (steps + 0.5) / max(1, len(more) // sft.SFTConfig.batch_size)
    path = sft.train(sft.SFTConfig(model=str(cold), out=str(d / "arm2"), seed=seed + 100, epochs=epochs), more)
    final(2, path, time.time() - t0, [(0.0, cold_score)])
    arms[2].update(sft_steps=steps, budget_s=arms[3]["seconds"])

    # 5: GRPO from the base
    run = d / "arm5"
    seconds, ckpts = grpo_arm(["--model", base], "shop", run, args, seed)
    base_score = evaluate(base, tasks, 0, 0, seed)["greedy_pass1"]
    final(5, ckpts[-1][1], seconds, curve_of(run, seconds, ckpts, base_score))
    arms[5]["base_greedy_pass1"] = base_score
    for arm in (3, 4, 5):
        arms[arm]["dynamics"] = [json.loads(line) for line in open(d / f"arm{arm}" / "metrics.jsonl")]
    return arms


def fmt(res: dict, trials: int) -> str:
    return (f"greedy pass^1 {res['greedy_pass1']:.3f}, sampled pass^1 {res['sampled_pass1']:.3f}, "
            f"pass^{trials} {res[f'pass{trials}']:.3f}, unasked writes {res['unasked']:.2f}")


def mean_spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def table(results: dict, args, minutes: float, command: str) -> str:
    seeds = sorted(results)
    k, n = args.trials, args.n_tasks
    avg = lambda xs: statistics.mean(list(xs))
    cold_s = [results[s][1].get("cold_start_s") for s in seeds]
    lines = [f"`{command}` ({minutes:.0f} min; seeds {', '.join(map(str, seeds))}; {n} shop test tasks against the "
             f"dynamic user, one task = {1 / n:.3f}; pass^{k} from {k} episodes a task at temperature "
             f"{args.temperature:g}; mean ± standard deviation over seeds)", "",
             f"| arm | greedy pass^1 | sampled pass^1 | pass^{k} | sampled episodes with an unasked write "
             "| seconds of training after the cold start |", "|---|---|---|---|---|---|",
             f"| 0 base (no cold start, no GRPO) | {mean_spread([results[s][5]['base_greedy_pass1'] for s in seeds])} "
             "| | | | |"]
    for arm, name in ARMS.items():
        col = lambda key: [results[s][arm]["final"][key] for s in seeds]
        lines.append(f"| {arm} {name} | {mean_spread(col('greedy_pass1'))} | {mean_spread(col('sampled_pass1'))} | "
                     f"{mean_spread(col(f'pass{k}'))} | {mean_spread(col('unasked'))} | "
                     f"{avg(results[s][arm]['seconds'] for s in seeds):.0f} |")
    lines += ["", (f"The cold start took {avg(cold_s):.0f} s a seed (playing the teacher and SFT), counted in no arm. "
                   if None not in cold_s else "") +
              f"Arm 2 ran {', '.join(str(results[s][2]['sft_steps']) for s in seeds)} SFT steps (seeds in order) in "
              f"the seconds arm 3's GRPO took; arms 3-5 ran {args.steps} GRPO steps of {args.tasks_per_step} tasks x "
              f"{args.group_size}.", "",
              "Paired differences of greedy pass^1, seed by seed (the same test tasks; arms 1-4 of a seed share its "
              "cold start, arm 5 starts from the base):", "",
              "| difference | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
              "|---|" + "---|" * (len(seeds) + 1)]
    for a, b in ((3, 1), (3, 2), (3, 4), (2, 1), (4, 1), (5, 1)):
        diffs = [results[s][a]["final"]["greedy_pass1"] - results[s][b]["final"]["greedy_pass1"] for s in seeds]
        lines.append(f"| {a} - {b} | " + " | ".join(f"{x:+.3f}" for x in diffs) + f" | {statistics.mean(diffs):+.3f} |")
    return "\n".join(lines) + "\n"


# ---- pictures (matplotlib, Agg) ----
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(arm: int) -> tuple:
    return tuple(c / 255 for c in COLORS[arm])


def mean_curve(curves: list[list]) -> list:
    """Point-wise mean of curves with the same number of points."""
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves))
            for i in range(min(len(c) for c in curves))]


def _draw(ax, curves: list[list], arm: int) -> None:
    """An arm's seeds (thin) and their mean (thick, labelled)."""
    for c in curves:
        ax.plot(*zip(*c), color=_color(arm), lw=0.8, alpha=0.5, marker=".", ms=3)
    ax.plot(*zip(*mean_curve(curves)), color=_color(arm), lw=2.2, marker="o", ms=4, label=f"{arm} {ARMS[arm]}")


def plot_pass1(results: dict, path) -> None:
    """Greedy test pass^1 against the dynamic user over seconds of training after the cold start, per arm."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    for arm in ARMS:
        _draw(ax, [results[s][arm]["curve"] for s in results], arm)
    ax.set(title="test pass^1 (greedy, dynamic user): seeds thin, mean thick",
           xlabel="seconds of training after the cold start", ylabel="pass^1")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DYNAMICS = [("reward per step", "reward_mean", "mean reward"), ("turns per episode", "turns_mean", "turns"),
            ("response tokens per episode", "response_tokens_mean", "tokens"),
            ("groups all correct", "all_correct_ratio", "fraction"), ("groups all wrong", "all_wrong_ratio", "fraction"),
            ("transfers to a human per episode", "tool_calls/transfer_to_human_agents", "calls"),
            ("episodes that wrote without a yes", "reward_info/unconfirmed_writes", "fraction")]


def plot_dynamics(results: dict, path) -> None:
    """Per GRPO step, arms 3-5 (seeds thin, mean thick): the training dynamics the paper tracks."""
    plt = _plt()
    fig, axes = plt.subplots(4, 2, figsize=(11, 12), sharex=True, constrained_layout=True)
    for ax, (title, key, unit) in zip(axes.flat, DYNAMICS):
        for arm in (3, 4, 5):
            _draw(ax, [[(r["step"], r.get(key, 0.0)) for r in results[s][arm]["dynamics"]] for s in results], arm)
        ax.set(title=title, ylabel=unit)
        ax.grid(alpha=0.3)
    for ax in (axes[-1, 0], axes[-2, 1]):  # the lowest panel of each column
        ax.set_xlabel("GRPO step")
        ax.tick_params(labelbottom=True)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(out: Path) -> None:
    """Rewrite a finished run's table and pictures from its results.json."""
    saved = json.loads((out / "results.json").read_text())
    results = {int(s): {int(a): r for a, r in arms.items()} for s, arms in saved["results"].items()}
    args = argparse.Namespace(**saved["args"])
    args.n_tasks = getattr(args, "n_tasks", None) or min(args.eval_tasks, len(make_env("shop").tasks("test")))
    if "minutes" not in saved:  # a run written before the table's wording changed: its log has the time
        done = [line for line in open(out / "log.txt") if "] done in " in line]
        saved["minutes"] = float(done[-1].split("] done in ")[1].split()[0])
        saved["command"] = f"./run python bench/ablation.py --out {out}"
    (out / "results.md").write_text(table(results, args, saved["minutes"], saved["command"]))
    plot_pass1(results, out / "ablation.png")
    plot_dynamics(results, out / "dynamics.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps of arms 3-5")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--points", type=int, default=3, help="checkpoints a GRPO arm is evaluated at (greedy)")
    p.add_argument("--eval-tasks", type=int, default=64, help="first N shop test tasks")
    p.add_argument("--trials", type=int, default=4, help="sampled episodes a task for pass^k (k = trials)")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled evaluation (GRPO's default, at "
                   "which arms 3-5 train)")
    p.add_argument("--skips", type=float, default=0.6, help="the teacher's share of writes without asking")
    p.add_argument("--cold-dynamic", type=int, default=1200, help="teacher tasks with the dynamic user, per seed")
    p.add_argument("--cold-static", type=int, default=400, help="teacher tasks with the static user, per seed")
    p.add_argument("--base", default="", help="the model every arm starts from (default: the pretrained tiny base)")
    p.add_argument("--out", default="", help="run directory (default: runs/ablation-<time>)")
    p.add_argument("--replot", default="", help="only rewrite the table and pictures of this finished run directory")
    p.add_argument("--quick", action="store_true", help="1 seed, 2 GRPO steps of 2 tasks x 4, 8 test tasks x 2, "
                   "48 + 16 teacher tasks: checks that the pipeline runs, measures nothing")
    args = p.parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    if args.quick:  # its sizes as defaults: options given with it still apply
        p.set_defaults(seeds=1, steps=2, tasks_per_step=2, group_size=4, points=2, eval_tasks=8, trials=2,
                       cold_dynamic=48, cold_static=16)
        args = p.parse_args(argv)
    for name, least in (("trials", 2), ("seeds", 1), ("eval_tasks", 1), ("points", 1), ("steps", 1)):
        if getattr(args, name) < least:
            raise SystemExit(f"bench/ablation.py: --{name.replace('_', '-')} {getattr(args, name)}: must be at least "
                             f"{least}" + (" (pass^k needs k >= 2 episodes a task)" if name == "trials" else ""))
    out = Path(args.out or f"runs/ablation-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    command = "./run python bench/ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    logf = open(out / "log.txt", "a")

    def log(msg: str) -> None:
        line = f"[ablation {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    t0 = time.time()
    base = args.base or str(sft.pretrain_tiny(sft.SFTConfig()))
    tasks = make_env("shop").tasks("test")[:args.eval_tasks]
    args.n_tasks = len(tasks)
    log(f"base {base}; {args.seeds} seeds x 5 arms; writing to {out}")
    results = {}
    for seed in range(args.seeds):
        results[seed] = run_seed(seed, base, tasks, args, out, log)
        json.dump({"args": vars(args), "results": results}, open(out / "results.json", "w"), default=str)
    minutes = (time.time() - t0) / 60
    md = table(results, args, minutes, command.strip())
    (out / "results.md").write_text(md)
    json.dump({"args": vars(args), "results": results, "minutes": minutes, "command": command.strip()},
              open(out / "results.json", "w"), default=str)
    plot_pass1(results, out / "ablation.png")
    plot_dynamics(results, out / "dynamics.png")
    print(md)
    log(f"done in {minutes:.1f} min: {out}/results.md, ablation.png, dynamics.png")
    return results


if __name__ == "__main__":
    main()

"""The paper's ablation in miniature: does the simulated user inside the RL rollout matter?

    ./run python bench/ablation.py --out bench/ablation-run     # every arm x 5 seeds (hours on 2 CPU cores)
    ./run python bench/ablation.py --out bench/ablation-run     # again: continues where it stopped
    ./run python bench/ablation.py --out R --threads 1 & ./run python bench/ablation.py --out R --threads 1  # 2 cores
    ./run python bench/ablation.py --replot bench/ablation-run  # the table and pictures from results.json
    ./run python bench/ablation.py --quick --out /tmp/q         # a smoke test: measures nothing

MUA-RL's ablation (TAU2 Retail, Qwen3-32B): base 50.2, cold start 58.2, RL only 61.6, cold start + RL 67.3; and its
claim that an agent trained while a user answers what it asks learns what fixed conversations cannot teach. Here, on
the shop domain (envs/shop_tasks.py), whose decisions (where a refund goes, how an exchange's new item ships) only a
user who answers what it is asked reveals (the dynamic user says its wish when asked; a proposal naming what it does
not want ends the conversation), from the committed `tiny` base (sft.pretrain_tiny: shop and its siblings under
their old policy, no decisions), for each seed:

  base       the base itself
  cold       cold start: SFT on the imperfect teacher's shop conversations (envs.shop.COLD_TEACHER: it writes without
             a yes in 30% of them, never asks what the user wants in 70%; kept when the database is right; SFT as
             models.TINY_COLD_START says), as the default run's but with the users of --cold-users (the dynamic
             user on 3 of every 4 tasks, the told user on the fourth: every arm's user talks as the dynamic one
             does, and a cold start that never heard a wish said unasked asks the told user to hear it again, which
             GRPO with that user then rewarded as much as the dynamic user's did: bench/README.md, try 11), and
             as many copy drills of those conversations beside them (--cold-drills, with_drills: try 12)
  sft        cold + more SFT of the same teacher on new conversations, for as many CPU seconds as arm `dynamic` took
  rl         GRPO from the base with the dynamic user, no cold start
  dynamic    cold + GRPO with the dynamic user (the paper's method)
  static     cold + GRPO with the told user (shop:told: the dynamic user, who also says what it wants of its
             request's decision unasked: the decision's information with no question to ask; until 2026-11-28 the
             static user, whose opening says who it is and what it wants too, which the cold start then had to be
             taught on its conversations, and those broke its copy after asking: bench/README.md, try 11)
  replay     cold + GRPO with the replayed user (the expert's user turns for the task, in order, whatever the agent
             says)
  teacher    cold + GRPO with the replay of the cold-start teacher's own conversation on the task (the paper's
             pre-scripted interaction: the static data its cold start was made of; shop:teacher)
  ctl_*      the negative control: dynamic, static (told) and replay again where every user wants the defaults
             (shop:<user>:default), evaluated there: asking is never needed, so the three must not differ

Every arm is evaluated against the dynamic user (ctl_* against shop:default's, and again against the real mix:
`final_mix`) on the same first --eval-tasks test tasks: greedy pass^1 and sampled pass^1 (--trials a task at
--temperature, GRPO's), on all tasks and on the decision tasks, and the share of decision episodes that asked what
the user wants before writing; each task's decision and whether its user wants the default. Intervals: 95%,
bootstrap over seeds and tasks together (stats.bootstrap_ci_seeds); differences paired by seed and task.

Each arm's result is written to --out/results.json as soon as it is measured, so a run that stops keeps what finished
and, started again with the same --out, continues with the next arm (an arm cut short is run again from its start;
a cold start whose checkpoint is gone is rebuilt from its seed, and whether its weights came out the same is recorded).
Two runs of the same command may share --out: each takes the next seed the other does not hold (a lock per seed) and
merges its arms into results.json under a lock. The tiny model keeps one core busy, not two: on 2 cores, two runs
with --threads 1 measured 1.68x one run's evaluations an hour. A seed's arms run in one process, so arm `sft`'s
CPU-second budget and arm `dynamic`'s are counted at the same thread count (recorded with each arm).
Writes results.md (the tables), ablation.png (final scores with intervals; greedy pass^1 against seconds of
training) and dynamics.png (per GRPO step: reward, asked-refund share, unasked writes, groups, turns).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (this script's directory): bench/rollout.py is not the rollout module
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from plumbing import coldstart  # noqa: E402
import grpo  # noqa: E402
from plumbing import models  # noqa: E402
import sft  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from envs import make_env  # noqa: E402
from envs.shop import COLD_TEACHER  # noqa: E402

ARMS = {"base": "base", "cold": "cold start", "sft": "cold start + more SFT", "rl": "GRPO, no cold start",
        "dynamic": "cold start + GRPO, dynamic user", "static": "cold start + GRPO, told user",
        "replay": "cold start + GRPO, replayed user", "teacher": "cold start + GRPO, replay of the teacher",
        "ctl_dynamic": "control: GRPO, dynamic user",
        "ctl_static": "control: GRPO, told user", "ctl_replay": "control: GRPO, replayed user"}
TRAIN_ENV = {"rl": "shop", "dynamic": "shop", "static": "shop:told", "replay": "shop:replay",
             "teacher": "shop:teacher", "ctl_dynamic": "shop:default", "ctl_static": "shop:told:default",
             "ctl_replay": "shop:replay:default"}
CAPS = dict(max_turns=30, max_new_tokens=128, max_context=1536)  # the default run's (grpo.Config)
TEACHER = dict(teacher_skips_confirm=COLD_TEACHER["skip_confirm"], teacher_skips_ask=COLD_TEACHER["skip_ask"])


def evaluate(path, env_name: str, n_tasks: int, trials: int, temperature: float, seed: int) -> dict:
    """Per task (dynamic user of `env_name`): greedy reward, sampled successes out of `trials` (0: greedy only), and
    on the decision tasks whether each episode asked what the user wants; each task's decision and whether its user
    wants the default."""
    model, tok = models.load_model(str(path), device="cpu", dtype=torch.float32)
    env, sim = make_env(env_name, n_train=0, n_test=n_tasks), make_user_sim("scripted")
    tasks = env.tasks("test")
    t0 = time.time()
    greedy = rollout(model, tok, env, tasks, 1, sim, RolloutConfig(greedy=True, **CAPS))
    res = {"greedy": {e.task_id: e.reward for e in greedy}, "decision": {t.id: t.meta["decision"] for t in tasks},
           "wants": {t.id: t.meta["wants"] for t in tasks},
           "greedy_asked": {e.task_id: e.reward_info["asked"] for e in greedy
                            if "asked" in e.reward_info}}
    if trials:
        gen = torch.Generator().manual_seed(seed)
        eps = rollout(model, tok, env, tasks, trials, sim, RolloutConfig(temperature=temperature, **CAPS), gen)
        res["sampled"], asked, unasked = {}, {}, {}
        for e in eps:
            res["sampled"][e.task_id] = res["sampled"].get(e.task_id, 0) + (e.reward == 1.0) / trials
            if "asked" in e.reward_info:
                asked[e.task_id] = asked.get(e.task_id, 0) + e.reward_info["asked"] / trials
            unasked[e.task_id] = unasked.get(e.task_id, 0) + bool(e.reward_info.get("unconfirmed_writes")) / trials
        res.update(sampled_asked=asked, sampled_unasked=unasked)
    res["eval_s"] = time.time() - t0
    return res


USER_ENV = {"dynamic": "shop", "static": "shop:static", "told": "shop:told", "replay": "shop:replay"}


def user_shares(spec: str) -> list[tuple[str, int]]:
    """--cold-users as (user, share): "dynamic:3,static:1" gives the dynamic user 3 of every 4 tasks."""
    return coldstart.user_shares(spec, "bench/ablation.py: --cold-users", USER_ENV)


def teacher_conversations(n: int, seed: int, users: list[str] | list[tuple[str, int]]) -> list[dict]:
    """The imperfect teacher on the first `n` tasks of the seed's shuffle, each task played with one of `users`
    (by task number, each user on its share of every sum-of-shares tasks; a bare name is a share of 1), kept as
    make_cold_start keeps them. The cold start is every GRPO arm's start, so it
    must be able to talk to each arm's user: one that saw only the dynamic user's vague opening won 0 of 16 static
    episodes (it skipped the authentication the static opening makes easy), so the static arm's GRPO had a mixed
    group in 1-6 of 120 and hardly trained, and the negative control came out dynamic > static by 0.06."""
    shares = [(u, 1) if isinstance(u, str) else u for u in users]
    cfg = sft.SFTConfig(env="shop", num_tasks=n, seed=seed, teacher_users=",".join(f"{u}:{k}" for u, k in shares),
                        **TEACHER)
    return coldstart.teacher_data(cfg)  # each task with one user, as make_cold_start keeps them with that user


def grpo_arm(start: list[str], env: str, out: Path, args, seed: int) -> tuple[float, float, list[tuple[int, Path]]]:
    """A GRPO run; returns its seconds, its CPU seconds and its checkpoints (step, model directory)."""
    t0, c0 = time.time(), time.process_time()  # --overwrite: an arm cut short is run again from its start
    grpo.main([*start, "--overwrite", "--env", env, "--steps", str(args.steps), "--seed", str(seed),
               "--eval-tasks", "0",
               "--tasks-per-step", str(args.tasks_per_step), "--group-size", str(args.group_size),
               "--temperature", str(args.temperature), "--save-every", str(-(-args.steps // args.points)),
               "--save-weights-only", "--log-episodes", "0", "--out-dir", str(out)])
    seconds, cpu_s = time.time() - t0, time.process_time() - c0
    ckpts = sorted((int(p.name.split("-")[1]), p / "model") for p in (out / "checkpoints").glob("step-*")
                   if not p.name.endswith(".tmp"))
    return seconds, cpu_s, ckpts


def run_arm(arm: str, seed: int, done: dict, base: str, args, out: Path, log) -> dict:
    """One arm of one seed, from the arms of that seed already in `done`."""
    d = out / f"seed{seed}"
    ev = lambda path, trials=args.trials, env=None: evaluate(  # noqa: E731
        path, env or ("shop:default" if arm.startswith("ctl_") else "shop"), args.eval_tasks, trials,
        args.temperature, seed)
    if arm == "base":
        return {"final": ev(base), "seconds": 0.0, "curve": []}
    if arm == "cold":
        t0 = time.time()
        convs = teacher_conversations(args.cold_tasks, seed, user_shares(args.cold_users))
        data = coldstart.with_drills(convs, seed, args.cold_drills)
        t1, c1 = time.time(), time.process_time()
        path = sft.train(sft.SFTConfig(model=base, out=str(d / "cold"), seed=seed, **models.TINY_COLD_START), data)
        t2, c2 = time.time(), time.process_time()  # SFT's cost a step, on its training alone (evaluation after)
        steps = max(1, int(models.TINY_COLD_START["epochs"] * (len(data) // sft.SFTConfig.batch_size)))
        return {"final": ev(path), "seconds": 0.0, "curve": [], "cold_start_s": t2 - t0,
                "sft_step_s": (t2 - t1) / steps, "sft_step_cpu_s": (c2 - c1) / steps,
                "tasks": sorted(c["task_id"] for c in convs), "weights": weights_hash(path)}
    cold = d / "cold"
    if arm != "rl" and not (cold / "model.safetensors").exists():
        # results.json outlives the checkpoints (a run continued on another machine has only the results file):
        # the cold start is rebuilt from its seed, and whether it came out bit for bit the same is recorded
        convs = teacher_conversations(args.cold_tasks, seed, user_shares(args.cold_users))
        cold = Path(sft.train(sft.SFTConfig(model=base, out=str(d / "cold"), seed=seed, **models.TINY_COLD_START),
                              coldstart.with_drills(convs, seed, args.cold_drills)))
        same = weights_hash(cold) == done["cold"].get("weights")
        log(f"seed {seed}: cold start rebuilt for {arm}; {'the same weights' if same else 'OTHER WEIGHTS than measured'}")
        done["cold"]["rebuilt_same"] = done["cold"].get("rebuilt_same", True) and same
    if arm == "sft":  # the same teacher on tasks the cold start did not see, for the compute GRPO took
        t0, c0 = time.time(), time.process_time()
        seen = set(done["cold"]["tasks"])  # the same shuffle, twice as far: the cold start's tasks, then new ones
        more = [c for c in teacher_conversations(2 * args.cold_tasks, seed, user_shares(args.cold_users))
                if c["task_id"] not in seen]
        # CPU seconds, not wall seconds: a run paused (kill -STOP) or sharing the machine keeps the same budget
        budget = done["dynamic"]["cpu_s"] - (time.process_time() - c0)
        steps = max(1, int(budget / done["cold"]["sft_step_cpu_s"]))
        more = coldstart.with_drills(more, seed + 100, args.cold_drills)  # the cold start's recipe, on new conversations
        epochs = (steps + 0.5) / max(1, len(more) // sft.SFTConfig.batch_size)
        path = sft.train(sft.SFTConfig(model=str(cold), out=str(d / "sft"), seed=seed + 100, epochs=epochs,
                                       lr=models.TINY_COLD_START["lr"]), more)
        seconds, cpu_s = time.time() - t0, time.process_time() - c0
        final = ev(path)
        return {"final": final, "seconds": seconds, "cpu_s": cpu_s, "sft_steps": steps,
                "curve": [(0.0, mean(done["cold"]["final"]["greedy"])), (seconds, mean(final["greedy"]))]}
    start_path = base if arm == "rl" else str(cold)
    flag = "--model" if arm == "rl" else "--init-from"
    seconds, cpu_s, ckpts = grpo_arm([flag, start_path], TRAIN_ENV[arm], d / arm, args, seed)
    rows = [json.loads(line) for line in open(d / arm / "metrics.jsonl")]
    step_s = [r["rollout_s"] + r["update_s"] for r in rows]
    first = done["base" if arm == "rl" else "cold"]["final"] if not arm.startswith("ctl_") else ev(start_path, 0)
    curve = [(0.0, mean(first["greedy"]))]
    for step, path in ckpts[:-1]:
        curve.append((seconds * sum(step_s[:step]) / sum(step_s), mean(ev(path, 0)["greedy"])))
    final = ev(ckpts[-1][1])
    mix = {"final_mix": ev(ckpts[-1][1], env="shop")} if arm.startswith("ctl_") else {}  # and against the real mix
    return {"final": final, **mix, "seconds": seconds, "cpu_s": cpu_s, "dynamics": rows,
            "curve": curve + [(seconds, mean(final["greedy"]))]}


@contextlib.contextmanager
def seed_held(out: Path, seed: int):
    """Yields whether this process holds `seed` (an exclusive lock on out/seed<N>.lock, let go on leaving or when
    the process dies): two runs of the same command share a run directory seed by seed."""
    with open(out / f"seed{seed}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def merged(path: Path, seed: int, arms: dict | None, head: dict | None = None) -> dict[int, dict]:
    """The results file as it is now, with `seed`'s arms replaced by `arms` and written back when `arms` is given:
    read and written under a lock, so a run sharing the directory keeps the seeds the other wrote meanwhile."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = json.loads(path.read_text()) if path.exists() else {}
        results = {int(s): a for s, a in saved.get("results", {}).items()}
        if arms is not None:
            results[seed] = arms
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**saved, **(head or {}), "results": results}))
            os.replace(tmp, path)
        return results


def code_commit() -> str:
    """The commit the arms ran from (recorded with each arm: a run resumed across sessions shows if the code moved),
    with "+changes" when the working tree differs from it."""
    import subprocess

    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no").stdout.strip() else "")


def weights_hash(model_dir) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()[:16]


def mean(d: dict) -> float:
    return sum(d.values()) / max(1, len(d))


ORDER = ["base", "cold", "dynamic", "sft", "static", "teacher", "replay", "rl", "ctl_dynamic", "ctl_static",
         "ctl_replay"]


def main(argv=None):
    import ablation_report as report  # bench/, beside this file

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps of the GRPO arms")
    p.add_argument("--tasks-per-step", type=int, default=16, help="tasks a GRPO step (at 4, the one-seed pilot's "
                   "asking share did not move in 30 steps; at 16 it rose from 0.41 to 0.8: bench/README.md)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--points", type=int, default=3, help="checkpoints a GRPO arm is evaluated at (greedy)")
    p.add_argument("--eval-tasks", type=int, default=256, help="first N shop test tasks")
    p.add_argument("--trials", type=int, default=4, help="sampled episodes a task")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled evaluation (GRPO's default, at "
                   "which the GRPO arms train)")
    p.add_argument("--cold-tasks", type=int, default=1600, help="tasks the cold start's teacher plays, per seed")
    p.add_argument("--cold-users", default="dynamic:3,told:1", help="the users the cold start's teacher talks to, "
                   f"each on its share of the tasks (comma-separated USER[:SHARE], of {', '.join(USER_ENV)}; "
                   "dynamic:3,static:1 gives the dynamic user 3 of every 4 tasks)")
    p.add_argument("--cold-drills", type=float, default=1.0, help="copy drills of the cold start's conversations "
                   "beside them, per conversation (with_drills; bench/README.md try 12: they ended seed 1's collapse "
                   "of the copy after asking; 0: none, as tries 10-11)")
    p.add_argument("--arms", default=",".join(ORDER), help="which arms (comma-separated); they run in the order of "
                   "the default")
    p.add_argument("--base", default="", help="the model every arm starts from (default: the tiny base)")
    p.add_argument("--out", default="", help="run directory (default: runs/ablation-<time>); an existing one is "
                   "continued with the settings it was started with")
    p.add_argument("--replot", default="", help="only rewrite the table and pictures of this run directory")
    p.add_argument("--quick", action="store_true", help="1 seed, 2 GRPO steps of 2 tasks x 4, 8 test tasks x 2, "
                   "48 teacher tasks: checks that the pipeline runs, measures nothing")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (default: torch's choice); on a small "
                   "machine two runs of this command with --threads 1 share the seeds and finish sooner than one")
    args = p.parse_args(argv)
    if args.replot:
        return report.write(Path(args.replot))
    if args.quick:  # its sizes as defaults: options given with it still apply
        p.set_defaults(seeds=1, steps=2, tasks_per_step=2, group_size=4, points=2, eval_tasks=8, trials=2,
                       cold_tasks=48)
        args = p.parse_args(argv)
    for name, least in (("trials", 1), ("seeds", 1), ("eval_tasks", 1), ("points", 1), ("steps", 1), ("threads", 0)):
        if getattr(args, name) < least:
            raise SystemExit(f"bench/ablation.py: --{name.replace('_', '-')} {getattr(args, name)}: must be at least "
                             f"{least}")
    user_shares(args.cold_users)  # refused by name before any seed runs
    if args.threads:  # and for grpo.main and sft.train, whose Accelerator would share the cores out again (cli.py)
        torch.set_num_threads(args.threads)
        os.environ["MUARL_THREADS"] = str(args.threads)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"bench/ablation.py: --arms: {', '.join(unknown)} not among {', '.join(ORDER)}")
    needs = {"sft": ["cold", "dynamic"], "rl": ["base"]}
    needs.update({a: ["cold"] for a in ("dynamic", "static", "replay", "teacher", "ctl_dynamic", "ctl_static",
                                        "ctl_replay")})
    out = Path(args.out or f"runs/ablation-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    base = args.base or str(sft.pretrain_tiny(sft.SFTConfig()))
    weights = Path(base) / "model.safetensors"  # a base rebuilt in place is another base
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "replot", "seeds", "arms", "threads")}
    settings["base_weights"] = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.exists() else None
    if saved and saved["settings"] != settings:
        raise SystemExit(f"bench/ablation.py: {out} was started with other settings ({saved['settings']}); "
                         "continue it with those, or choose another --out")
    results = {int(s): arms_ for s, arms_ in saved.get("results", {}).items()}
    for arm in arms:
        for need in needs.get(arm, []):
            if need not in arms and any(need not in results.get(s, {}) for s in range(args.seeds)):
                raise SystemExit(f"bench/ablation.py: arm {arm} needs {need} first (--arms)")
    logf = open(out / "log.txt", "a")

    def log(msg: str) -> None:
        line = f"[ablation {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    commit = code_commit()
    log(f"code {commit}; base {base}; seeds 0-{args.seeds - 1}; arms {', '.join(arms)}; {torch.get_num_threads()} "
        f"threads; writing to {out}")
    for seed in range(args.seeds):
        with seed_held(out, seed) as held:  # a seed another run of this command holds is left to it
            if not held:
                log(f"seed {seed}: another run holds it")
                continue
            done = results[seed] = merged(path, seed, None).get(seed, {})
            for arm in [a for a in ORDER if a in arms]:
                if arm in done:
                    continue
                t0 = time.time()
                done[arm] = run_arm(arm, seed, done, base, args, out, log)
                done[arm].update(commit=commit, threads=torch.get_num_threads())
                f = done[arm]["final"]
                log(f"seed {seed} {arm} ({ARMS[arm]}): greedy {mean(f['greedy']):.3f}, sampled "
                    f"{mean(f.get('sampled', {})):.3f}, asked {mean(f.get('sampled_asked', {})):.2f} "
                    f"({time.time() - t0:.0f}s)")
                results = merged(path, seed, done, {"settings": settings, "base": base})
    results = merged(path, 0, None)  # with the seeds another run wrote
    if not results:
        log("no seed measured yet: another run holds each")
        return results
    md = report.write(out)
    print(md)
    log(f"done: {out}/results.md, ablation.png, dynamics.png")
    return results


if __name__ == "__main__":
    main()

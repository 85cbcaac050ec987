"""plumbing/pipeline.py: the run around the GRPO step (grpo.grpo_step): the run's record (Run), its set-up in two
phases (`start`: the Accelerator, run directory, environment, user; `load`: policy and optimizer, frozen reference
(plumbing/policy.py), resumed state), the policy as the rollout decodes with it, greedy evaluation, each step's logs,
the loop of steps with its checkpoints and stop signals, and the summary. Machinery: a first reader skips it; grpo.main
calls it phase by phase."""
from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from plumbing import checkpoints, cli, disk, lora, metrics, models, policy, rundir, shard, stopping
from fast import deadlines
from plumbing.options import check_activation_checkpointing, trains_on_eval_tasks, validate


@dataclass
class Run:
    """A GRPO run: what `start` makes, what `load` adds, what each step reads and advances."""
    cfg: Any                         # grpo.Config: every option (written to config.json)
    acc: Any                         # the Accelerator
    dir: Path                        # the run directory
    env: Any                         # the environment (envs.Environment)
    eval_env: Any                    # the held-out evaluations' (--eval-env; else env itself)
    tasks: list                      # the training split's tasks
    user_sim: Any                    # the simulated user (envs.users.UserSim)
    resume_from: Path | None = None  # the checkpoint a --resume continues from
    changes: dict | None = None      # the options a --resume changed (resumes.jsonl)
    tok: Any = None                  # the tokenizer (load)
    model: Any = None                # the policy, prepared by Accelerate (load)
    ref: Any = None                  # the frozen reference; with LoRA the policy itself; None without KL (load)
    opt: Any = None                  # the optimizer (load)
    sched: Any = None                # the learning-rate schedule (load)
    sampling: Any = None             # how the rollout samples (fast.batched_rollout.RolloutConfig; load)
    first_step: int = 0              # the step this run starts at: a resumed run's (load)
    done_steps: int = 0              # steps whose update and logs are complete
    stop_signals: Any = None         # Ctrl-C, SIGTERM, SIGHUP (stopping.StopOnInterrupt; grpo.main)
    rng_at_step: Any = None          # the RNG state at the step's start, restored when its rollout is abandoned


def step_tasks(tasks: list, cfg, step: int, rank: int, world: int) -> list:
    """This process's share of the step's tasks. The order is a seeded permutation per epoch, so the data
    position is a function of the step alone and a resumed run sees the same tasks."""
    out, n = [], len(tasks)
    for k in range(step * cfg.tasks_per_step, (step + 1) * cfg.tasks_per_step):
        epoch, i = divmod(k, n)
        perm = list(range(n))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(perm)
        out.append(tasks[perm[i]])
    return out[rank::world]  # whole groups per process: group statistics never cross processes


# ---------------------------------------------------------------------------------------------------------
def start(cfg, resume_from: Path | None, changes: dict) -> Run:
    """What a run needs before its policy, checked: the Accelerator, the run directory, the environment and its
    user. Then the entry point makes or finds the policy's start (the cold start, for tiny) and calls `load`."""
    from envs import load_tasks
    from fast.batched_rollout import RolloutConfig
    from plumbing.users import make_user_sim, user_sim_options

    cli.check_report_to(cfg.report_to, "grpo.py")
    # the trackers are given the run directory once it is claimed (below): Accelerate refuses a tracker that writes
    # files (TensorBoard) when the Accelerator is made without a directory
    acc = cli.make_accelerator(cfg.dist_timeout, mixed_precision="bf16" if cfg.bf16 else "no")
    validate(cfg, acc.num_processes)
    try:  # the rollout's options (a malformed --decode-slots among them) stop now, not once the model has loaded
        RolloutConfig.from_options(cfg, on_gpu=acc.device.type != "cpu")
    except SystemExit as e:
        raise SystemExit(f"grpo.py: {e}") from None
    shard.check_accelerator(acc)
    check_activation_checkpointing(acc, cfg.gradient_checkpointing, "grpo.py")
    if cfg.lora_rank:
        lora.check_backend(acc)
    models.seed_everything(cfg.seed)
    run_dir = resume_from.parents[1] if resume_from else Path(
        cfg.out_dir or f"runs/grpo-{cfg.env.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}")
    # An existing run is refused now unless --resume or --overwrite, and a directory another run is using, always
    # (run.lock); nothing is removed until the run has loaded.
    run_dir = rundir.claim(acc, run_dir, resuming=bool(cfg.resume), overwrite=cfg.overwrite)
    if cfg.lora_rank and cfg.overwrite:  # the adapters' checkpoints need their base where it is
        lora.check_base_kept(cfg.init_from or cfg.model, run_dir, "grpo.py: --overwrite")
    cfg.out_dir = str(run_dir)
    env, tasks = load_tasks(cfg.env, cfg.split, "grpo.py", **({"reward": cfg.env_reward} if cfg.env_reward else {}))
    eval_env = env
    if cfg.eval_env and cfg.eval_env != cfg.env:
        eval_env = load_tasks(cfg.eval_env, "test", "grpo.py", "--eval-env",
                              **({"reward": cfg.env_reward} if cfg.env_reward else {}))[0]
    if cfg.tool_timeout:
        for e in {id(e): e for e in (env, eval_env)}.values():
            deadlines.prepare(e)  # the keeper of the tool calls' probes, forked before the model loads (deadlines.py)
    if cfg.report_to:  # its files in the run directory (TensorBoard's: RUN_DIR/<run name>/)
        from accelerate.tracking import filter_trackers

        acc.project_configuration.set_directories(str(run_dir))
        acc.log_with = filter_trackers([cfg.report_to], acc.logging_dir)
        acc.init_trackers(run_dir.name, config=asdict(cfg))
    user_sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    if cfg.user_sim == "hf":  # each process loaded its own copy of the user: the same one?
        shard.check_same_weights(acc, user_sim.sim.model, f"--user-model {cfg.user_model}")
    if cfg.user_sim == "scripted":  # fail now, not after the model has loaded
        checks = [(cfg.env, env, tasks[0])]
        if eval_env is not env and cfg.eval_tasks and eval_env.tasks("test"):
            checks.append((cfg.eval_env, eval_env, eval_env.tasks("test")[0]))
        for name, e, task in checks:
            try:
                e.scripted_user(task)
            except NotImplementedError:
                raise SystemExit(f"grpo.py: --user-sim: {name} has no scripted user; use --user-sim openai or hf")
    return Run(cfg=cfg, acc=acc, dir=run_dir, env=env, eval_env=eval_env, tasks=tasks, user_sim=user_sim,
               resume_from=resume_from, changes=changes)


def load(run: Run) -> None:
    """The rest of what a run needs, once its start (cfg.init_from or cfg.model) exists: the policy with its
    optimizer, the frozen reference, the resumed state; then the run directory is opened."""
    from fast.batched_rollout import RolloutConfig
    from plumbing.options import check_max_context

    cfg, acc, env, tasks, resume_from, run_dir = run.cfg, run.acc, run.env, run.tasks, run.resume_from, run.dir

    def check_contexts(tok):
        check_max_context(tok, env, tasks, cfg.max_context)
        if run.eval_env is not env and cfg.eval_tasks:
            check_max_context(tok, run.eval_env, run.eval_env.tasks("test")[:cfg.eval_tasks], cfg.max_context)
    start, early = cfg.init_from or cfg.model, None
    if start != "tiny":  # a --max-context no episode can start in stops before the weights load (minutes at 8B)
        with contextlib.suppress(SystemExit):  # a start that does not load: load_policy names it, with its option
            early = models.start_tokenizer(start)
    if early is not None:
        check_contexts(early)
    policy.load_policy(run)
    if early is None:
        check_contexts(run.tok)
    checkpoints.check_first_room(acc, run)
    run.first_step = checkpoints.load(acc, resume_from, cfg.tasks_per_step, run.sched) if resume_from else 0
    if resume_from:
        acc.print(f"[grpo] resumed from {resume_from} at step {run.first_step}")
    if cfg.overwrite and not resume_from:  # the run it replaces goes only if its user answers: a dead endpoint
        from plumbing.users import unanswered  # would stop this run at its first step (the main process decides)

        why = unanswered(run.user_sim) if acc.is_main_process and rundir.run_files(run_dir) else None
        if disk.any_failed(acc, why is not None):
            raise SystemExit(f"grpo.py: --overwrite: the user simulator does not answer, so the run in {run_dir} is "
                             f"kept: {why or '(on another process)'}. Fix the endpoint, then run the same command "
                             "again")
    # Once everything has loaded: a run that fails to start leaves the directory as it was.
    with rundir.together(acc):  # a disk that refuses config.json stops every process
        rundir.open_run(acc, run_dir, asdict(cfg), run.first_step if cfg.resume else None, run.changes, cfg.overwrite)
    run.done_steps = run.first_step  # steps whose update and logs are complete
    run.sampling = RolloutConfig.from_options(cfg, on_gpu=acc.device.type != "cpu")
    return run


@contextlib.contextmanager
def decoding(run: Run):
    """The current policy as the rollout decodes with it: its full weights gathered once when sharded, under the
    run's autocast, LoRA adapters folded into the base with --lora-decode merged."""
    with shard.full_weights(run.model, run.acc.device) as decoder, run.acc.autocast(), \
            lora.merged_for_decoding(run.acc.unwrap_model(decoder), run.cfg.lora_decode == "merged") as policy:
        yield policy


def evaluate(run, tag: str) -> dict:
    """Greedy pass^1 on the first --eval-tasks test tasks (eval.py's summary); eval-<tag>.jsonl holds the episodes."""
    from accelerate.utils import gather_object

    from fast.batched_rollout import rollout
    from plumbing.stats import summarize

    cfg, acc = run.cfg, run.acc
    if not cfg.eval_tasks:
        return {}
    test = run.eval_env.tasks("test")[:cfg.eval_tasks]
    with decoding(run) as policy:
        eps = rollout(policy, run.tok, run.eval_env, test[acc.process_index::acc.num_processes], 1, run.user_sim,
                      replace(run.sampling, greedy=True))
    eps = gather_object([e.to_json(tokens=True) for e in eps])
    s = summarize(eps, 1, {t.id: t.meta for t in test})
    out = {f"eval/{tag}/pass1": s["pass^1"], f"eval/{tag}/tasks": s["tasks"]} if not s["scored"] else {
        f"eval/{tag}/pass1": s["pass^1"], f"eval/{tag}/tasks": s["tasks"],
        f"eval/{tag}/by_meta": s.get("by_meta", {}),  # the reward's checks over the episodes that record them
        f"eval/{tag}/rates": {k: r["rate"] for k, r in s.get("rates", {}).items()}}
    with rundir.together(acc):  # a disk that refuses these stops every process
        if acc.is_main_process:
            when = {"before": "before training", "after": "after training"}.get(tag, f"at step {tag[4:]}")
            with rundir.writing(run.dir, f"eval-{tag}.jsonl", f"the episodes of the evaluation {when}", "w") as f:
                f.writelines(disk.json_line(e) for e in eps)
            if tag == "before":  # a resumed run's summary still holds it
                with rundir.refusals(run.dir, f"writing eval-before.json to {run.dir}", "The run has not trained"):
                    disk.write_json_atomic(run.dir / "eval-before.json", out)
    if not s["scored"]:
        first = next((e["reward_info"].get("error") for e in eps if e.get("reward_info")), None)
        acc.print(f"[grpo] eval ({tag}): none of the {len(eps)} episodes was scored (all failed on infrastructure; "
                  f"the first error: {first})")
        return out
    kinds = "; ".join(f"{k}: " + ", ".join(f"{v} {r['pass^1']:.2f}" for v, r in vs.items())
                      for k, vs in list(s.get("by_meta", {}).items())[:2])
    where = f" of {cfg.eval_env}" if run.eval_env is not run.env else ""
    rates = "".join(f", {k} {r['rate']:.2f}" for k, r in s.get("rates", {}).items())
    acc.print(f"[grpo] eval ({tag}) on {s['tasks']} test tasks{where}, greedy: pass^1 = {s['pass^1']:.3f}"
              + (f" ({kinds})" if kinds else "") + rates)
    if tag == "after" and (run.dir / "eval-before.jsonl").exists():
        out["eval/gain"] = metrics.gain(run.dir, {t.id: t.meta for t in test}, acc.print)
    return out


def train(run: Run, grpo_step) -> None:
    """The loop of GRPO steps (grpo.grpo_step) from the run's first step, with its checkpoints. A step where every
    episode failed on infrastructure stops the run; Ctrl-C, SIGTERM or SIGHUP stops it after the step, SIGTERM or
    SIGHUP on one process by abandoning the step's rollout (all say how to continue)."""
    from tqdm.auto import tqdm

    cfg, acc = run.cfg, run.acc
    bar = tqdm(range(run.first_step, cfg.steps), initial=run.first_step, total=cfg.steps,
               disable=not acc.is_main_process, desc="grpo", dynamic_ncols=True)
    resume_hint = f"accelerate launch grpo.py --resume {run.dir}"
    saved, step = run.first_step, run.first_step  # the newest checkpoint's step; the step in progress
    signals = run.stop_signals
    try:
        for step in bar:
            m, failed = grpo_step(run, step)
            if m is None:  # stop, loudly, rather than train on nothing step after step
                if step > saved:
                    checkpoints.save(acc, run, step)
                then = (f"then continue with {resume_hint} (the user-simulator options may change on --resume)"
                        if step else f"then start again (--overwrite {run.dir})")
                acc.end_training()
                raise SystemExit(f"grpo.py: step {step + 1}: all {len(failed)} episodes failed on infrastructure, "
                                 f"so there is nothing to train on; the first error: {failed[0]['error']}\nFix "
                                 f"it, {then}.")
            if acc.is_main_process:
                bar.set_postfix(reward=f"{m.get('reward_mean', 0):.3f}", kl=f"{m.get('kl', 0):.4f}")
                tqdm.write(metrics.console_line(m, failed, m["rollout_s"], m["update_s"]))
            stop = signals.agreed(acc)  # every process stops after the same step
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stop:
                checkpoints.save(acc, run, step + 1)
                saved = step + 1
            if stop and step + 1 < cfg.steps:
                bar.close()
                acc.end_training()
                acc.print(f"[grpo] stopped by {stopping.SIGNALS[signals.asked]} after step {step + 1} of {cfg.steps}, "
                          f"checkpoint saved; continue with: {resume_hint}")
                raise SystemExit(signals.exit_code())
    except stopping.Abandoned as e:  # SIGTERM/SIGHUP in a rollout, or any stop signal in an evaluation of the step
        bar.close()
        if run.done_steps == step:  # abandoned in the rollout: the state is the last step's, RNG included
            models.restore_rng(run.rng_at_step)
        if run.done_steps > saved:
            checkpoints.save(acc, run, run.done_steps)
            saved = run.done_steps
        where = (f"checkpoint of step {saved} saved; continue with: {resume_hint}" if saved else
                 f"no step had finished; --resume {run.dir} starts it again")
        acc.print(f"\n[grpo] stopped by {stopping.SIGNALS[e.signame]} during step {step + 1}: {where}")
        acc.end_training()
        raise SystemExit(signals.exit_code()) from None
    except KeyboardInterrupt:  # the second Ctrl-C: stop at once; the step in progress is lost
        bar.close()
        where = (f"the newest checkpoint is step {saved}; continue with: {resume_hint}" if saved else
                 f"no checkpoint was written; --resume {run.dir} starts it again")
        acc.print(f"\n[grpo] interrupted during step {step + 1}: {where}")
        acc.end_training()
        raise SystemExit(130) from None


def log_step(run: Run, step: int, m: dict, episodes: list) -> None:
    """After the step's update: the held-out evaluation every --eval-every steps (eval/pass1 in `m`), then the step's
    line in metrics.jsonl, --log-episodes of its episodes (with their tokens and loss masks) in episodes.jsonl, and
    the trackers. A stop signal during the evaluation leaves it; the step is logged, then the signal raised."""
    from accelerate.utils import gather_object

    cfg, acc, stopped = run.cfg, run.acc, None
    if cfg.eval_tasks and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:  # last: "after"
        t2 = time.time()
        try:
            with run.stop_signals.abandoning():  # a stop signal leaves the evaluation; the step is logged and saved
                held = evaluate(run, f"step{step + 1}")
                m["eval/pass1"] = held.get(f"eval/step{step + 1}/pass1")
                m.update({f"eval/pass1/{k}={v}": r["pass^1"] for k, vs in held.get(f"eval/step{step + 1}/by_meta",
                                                                                  {}).items() for v, r in vs.items()})
                m.update({f"eval/{k}": v for k, v in held.get(f"eval/step{step + 1}/rates", {}).items()})
        except stopping.Abandoned as e:
            stopped = e
        m["eval_s"] = time.time() - t2
    samples = gather_object([e.to_json(tokens=True) for e in episodes[:max(0, cfg.log_episodes)]])
    with rundir.together(acc):  # a disk that refuses a line stops every process here, a stop signal or not
        if acc.is_main_process:
            with rundir.writing(run.dir, "metrics.jsonl", f"step {step + 1}'s metrics") as f:
                f.write(json.dumps(m) + "\n")
            with rundir.writing(run.dir, "episodes.jsonl", f"step {step + 1}'s episodes") as f:
                for s in samples[:cfg.log_episodes]:
                    f.write(disk.json_line({"step": step + 1, **s}))
    if cfg.report_to:
        acc.log(m, step=step + 1)
    run.done_steps = step + 1
    if stopped:
        raise stopped


def write(run, results: dict) -> None:
    """summary.json and the learning curves (curves.png: `python eval.py --plot RUN_DIR` draws them again)."""

    with rundir.together(run.acc):  # a disk that refuses these stops every process
        if run.acc.is_main_process:
            with rundir.refusals(run.dir, "writing summary.json", "Every step was saved (--resume evaluates)"):
                trained_on = {"eval_tasks_trained_on": True} if trains_on_eval_tasks(run.cfg) else {}
                disk.write_json_atomic(run.dir / "summary.json", {"steps": run.cfg.steps, **trained_on, **results})
            with rundir.refusals(run.dir, "drawing curves.png", "summary.json holds the results",
                                 f"python eval.py --plot {run.dir}"):
                if (run.dir / "metrics.jsonl").exists():
                    metrics.plot_run(run.dir)
    run.acc.wait_for_everyone()  # all tear down together: a peer still in a collective can hang gloo's teardown
    run.acc.end_training()
    run.acc.print(f"[grpo] done. Run directory: {run.dir} (metrics.jsonl, curves.png, episodes.jsonl, checkpoints/, "
                  "summary.json)")



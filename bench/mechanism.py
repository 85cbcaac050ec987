"""The paper's mechanism, isolated: does GRPO with a user who answers what it is asked teach an agent to ask?

    ./run python bench/mechanism.py --out bench/mechanism --seeds 10   # every arm x 10 seeds; again: continues
    ./run python bench/mechanism.py --replot bench/mechanism            # the table from results.json

One decision and nothing else to learn (tests/ask_env.py): a refund whose destination is the user's (the default for
half the users, another for the other half), one tool, `refund(to)`. A tiny model, cold-started on the teacher's
conversations (it asks where the refund goes in ~30% of them), is trained by grpo.main with each user:

  dynamic        the user says where only when asked: asking earns 1, not asking 0.5
  static         the user says where in its opening: asking earns nothing more
  replay         the user's side of the teacher's own conversation, replayed whatever the agent says
  control        every user wants the default (dynamic user): asking can change nothing
  static-control every user wants the default (static user)

Each checkpoint (the cold start and every arm's last) is measured on the same 64 held-out tasks against the dynamic
user with the real mix of destinations, sampled at the training temperature (--trials per task): the asking rate,
pass^1, and pass^1 on the tasks whose user wants another destination than the default. tests/test_mechanism.py runs
this at one seed with the settings `TEST` below and asserts what the module doc of tests/ask_env.py predicts: the
asking rate rises by at least 0.3 with the dynamic user, and by at least 0.3 more than with the static user or in the
controls, which move it by at most 0.2 (their drift: bench/README.md).

What this shows is the mechanism (information only a responsive user holds, a reward that depends on it, and a policy
that can ask); it says nothing of the size of the paper's gain on tau2.

Results are written to --out/results.json arm by arm, so a run that stops continues with the next arm when started
again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (this script's directory): bench/rollout.py is not the rollout module
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import eval as evaluation  # noqa: E402
import grpo  # noqa: E402
import muarl  # noqa: E402
import sft  # noqa: E402
from plumbing import coldstart, models  # noqa: E402
from tests import ask_env  # noqa: E402

ARMS = {"dynamic": "AskEnv", "static": "AskStaticEnv", "replay": "AskReplayEnv", "control": "AskControlEnv",
        "static-control": "AskStaticControlEnv"}


@dataclass
class Settings:
    conversations: int = 256  # cold-start conversations (half with the dynamic user, half with the static one)
    sft_epochs: float = 4.0
    sft_lr: float = 5e-3
    drills: int = 1024        # copy drills (ask_env.copy_drills) beside the whole conversations and their windows
    arch: str = "llama"       # Qwen3's query/key norms slow a tiny model's learning to copy (models.tiny_config)
    hidden: int = 64
    layers: int = 2
    steps: int = 20           # GRPO steps of 4 tasks x 8
    lr: float = 2.5e-4         # at 5e-4 the controls drifted up to 0.24 (bench/README.md)
    temperature: float = 1.0  # sampling, in training and in the measurement
    trials: int = 4           # sampled episodes per held-out task
    test_tasks: int = 64
    grpo_args: str = ""       # more grpo.py options, space-separated


TEST = Settings()  # tests/test_mechanism.py's


def env_name(arm: str) -> str:
    return f"tests.ask_env:{ARMS[arm]}"


def cold_start(out: Path, seed: int, s: Settings) -> Path:
    """A random ~0.1M-parameter model (Llama by default) over a tokenizer of the domain's texts, fine-tuned on the
    teacher's conversations."""
    data = ask_env.cold_start_data(s.conversations, seed=seed)
    tok = models.env_tokenizer(ask_env.AskEnv(), vocab_size=512)  # the chat template's text merged: short episodes
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    cfg = models.tiny_config(len(tok), arch=s.arch, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
                             num_hidden_layers=s.layers, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=s.hidden // 4, pad_token_id=tok.pad_token_id,
                             eos_token_id=muarl.end_of_turn_id(tok))
    init = out / "random"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(init)
    tok.save_pretrained(init)
    # with short windows of them and copy drills: copying is found there and carries over to whole conversations
    # (coldstart.windows says why a model trained from scratch needs them)
    drills = coldstart.windows(data, sizes=(1, 2)) + ask_env.copy_drills(s.drills, seed)
    return sft.train(sft.SFTConfig(model=str(init), out=str(out / "cold"), epochs=s.sft_epochs, batch_size=8,
                                   lr=s.sft_lr, seed=seed), data + drills)


def train(start: Path, arm: str, out: Path, seed: int, s: Settings) -> tuple[Path, list[dict]]:
    """grpo.main with the arm's user; the last checkpoint and the per-step metrics."""
    grpo.main(["--init-from", str(start), "--env", env_name(arm), "--steps", str(s.steps), "--tasks-per-step", "4",
               "--group-size", "8", "--lr", str(s.lr), "--warmup-steps", "3", "--max-new-tokens", "32",
               "--max-context", "512", "--max-turns", "6", "--eval-tasks", "0", "--save-every", "1000",
               "--micro-batch-size", "16", "--temperature", str(s.temperature), "--seed", str(seed),
               "--out-dir", str(out), *s.grpo_args.split()])
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())["checkpoint"]
    return out / "checkpoints" / latest / "model", [json.loads(x) for x in open(out / "metrics.jsonl")]


def measure(agent: Path, out: Path, seed: int, s: Settings) -> dict:
    """Held-out, against the dynamic user with the real mix: asking rate, pass^1, pass^1 where the user wants
    another destination than the default."""
    evaluation.main(["--agent", str(agent), "--env", env_name("dynamic"), "--split", "test", "--num-tasks",
                     str(s.test_tasks), "--trials", str(s.trials), "--temperature", str(s.temperature),
                     "--max-new-tokens", "32", "--max-context", "512", "--max-turns", "6", "--seed", str(seed),
                     "--out-dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    return {"asking": summary["rates"]["asked"]["rate"], "pass^1": summary["pass^1"],
            "pass^1_other": summary["by_meta"]["wants"]["other"]["pass^1"]}


def run_seed(seed: int, arms: list[str], work: Path, s: Settings, done: dict | None = None, record=None) -> dict:
    """The cold start of one seed and each arm trained from it, measured; `record(arm, result)` after each."""
    done = dict(done or {})
    start = cold_start(work / "start", seed, s)
    if "cold" not in done:
        done["cold"] = measure(start, work / "eval-cold", seed, s)
        record and record("cold", done["cold"])
    for arm in arms:
        if arm in done:
            continue
        t0 = time.time()
        ckpt, rows = train(start, arm, work / arm, seed, s)
        result = measure(ckpt, work / f"eval-{arm}", seed, s)
        result["train_asking"] = [r.get("reward_info/asked") for r in rows]
        result["train_reward"] = [r["reward_mean"] for r in rows]
        result["seconds"] = round(time.time() - t0, 1)
        done[arm] = result
        record and record(arm, result)
    return done


def table(results: dict) -> str:
    arms = ["cold", *ARMS]
    lines = ["| seed | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for seed, r in sorted(results["seeds"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {seed} | " + " | ".join(
            f"{r[a]['asking']:.2f} / {r[a]['pass^1_other']:.2f}" if a in r else "" for a in arms) + " |")
    deltas = {a: [r[a]["asking"] - r["cold"]["asking"] for r in results["seeds"].values() if a in r] for a in ARMS}
    lines.append("| change in asking, mean [min, max] | | " + " | ".join(
        f"{sum(d) / len(d):+.2f} [{min(d):+.2f}, {max(d):+.2f}]" if d else "" for d in deltas.values()) + " |")
    return ("Held-out asking rate / pass^1 where the user wants another destination (dynamic user, real mix, "
            f"sampled), settings {results['settings']}\n\n" + "\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/mechanism-run")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--replot", default="")
    for k, v in asdict(TEST).items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    a = p.parse_args(argv)
    if a.replot:
        print(table(json.loads((Path(a.replot) / "results.json").read_text())), end="")
        return
    s = Settings(**{k: getattr(a, k) for k in asdict(TEST)})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"settings": asdict(s), "seeds": {}}
    if results["settings"] != asdict(s):
        raise SystemExit(f"bench/mechanism.py: {path} was made with other settings: {results['settings']}")
    for seed in range(a.seeds):
        def record(arm, result, seed=str(seed)):
            results["seeds"].setdefault(seed, {})[arm] = result
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            os.replace(tmp, path)
            print(f"[mechanism] seed {seed} {arm}: asking {result['asking']:.3f}, pass^1 {result['pass^1']:.3f}, "
                  f"other {result['pass^1_other']:.3f}", flush=True)
        import tempfile

        with tempfile.TemporaryDirectory(prefix=f"mechanism-{seed}-") as work:
            run_seed(seed, a.arms.split(","), Path(work), s, results["seeds"].get(str(seed)), record)
    (out / "results.md").write_text(table(results))
    print(table(results), end="")


if __name__ == "__main__":
    main()

"""The modules import one way, so a reader can start at the bottom and read up. The reading path first (README.md),
then the machinery beside it, which a first reader skips:

    envs/              the world: tasks, tools, databases, rewards, the episode rule, the simulated users
    toolcall.py        the agent's tool calls as text (format, parse) and the tool-aware chat template
    muarl.py           1. the episode in tokens: Episode, the turn's end, template deltas, masks, the padded batch
    rollout.py         2. one episode played turn by turn with model.generate
    loss.py            3. the objective: advantages, k3, the clipped policy term, grpo_loss (pure functions)
    grpo.py            4. the step (decide, train_on_episodes) and main(), on the machinery below

    models.py          models and tokenizers loaded (tiny from its environment's text, checkpoints, hub ids)
    logprobs.py        the chunked log-prob kernel the trainer scores tokens with
    decode.py          one decoding step: grouped-query attention on the cache, the draw, torch.compile
    engine.py          batched decoding with each episode's KV cache kept across turns (torch, transformers only)
    opening.py         a group's opening computed once in the update (through logprobs, with decode's cache plumbing)
    cli.py, options.py the entry points' plumbing, and their shared option groups
    shard.py, memory.py   the backends (DDP, FSDP2, DeepSpeed) and the memory estimate
    lora.py            LoRA adapters (peft)
    batched_rollout.py many episodes at once over the engine, users answering from their own thread
    deadlines.py       every tool call under a deadline (a forked copy tries it first)
    coldstart.py, sft.py, eval.py    cold-start data, SFT and the tiny base, evaluation
    metrics.py, checkpoints.py, rundir.py, pipeline.py   what a run logs, saves, its directory, how it is set up and looped

Checked on the source (every import statement, function-local ones included), so a lazy import cannot hide a
dependency that runs later. Nothing below envs/ imports an environment (the tiny tokenizer is trained on the text of
the environment it is given); envs/ import nothing of the agent's side."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {  # module -> the project modules it may import
    "envs": {"envs"},
    "toolcall": set(),
    "muarl": {"toolcall"},
    "rollout": {"envs", "muarl", "toolcall"},
    "loss": {"logprobs"},
    "grpo": {"cli", "logprobs", "lora", "loss", "metrics", "muarl", "opening", "options", "pipeline", "rundir",
             "shard"},
    "cli": set(),
    "lora": set(),
    "options": {"cli", "lora", "loss"},
    "models": {"muarl", "lora", "toolcall", "options"},
    "logprobs": set(),
    "opening": {"logprobs", "decode"},
    "shard": set(),
    "memory": {"cli", "lora"},
    "decode": set(),
    "engine": {"decode"},
    "metrics": set(),
    "checkpoints": {"cli", "shard", "lora", "memory"},
    "rundir": {"cli", "checkpoints"},
    "deadlines": {"envs"},
    "batched_rollout": {"envs", "muarl", "rollout", "engine", "models", "cli", "deadlines"},
    "coldstart": {"envs", "cli", "muarl", "logprobs", "batched_rollout", "toolcall"},
    "sft": {"envs", "cli", "muarl", "models", "logprobs", "options", "shard", "checkpoints", "lora", "coldstart",
            "memory"},
    "stats": set(),
    "eval": {"envs", "cli", "muarl", "models", "batched_rollout", "memory", "checkpoints", "lora", "options", "shard",
             "metrics", "stats", "deadlines"},
    "pipeline": {"envs", "cli", "muarl", "models", "logprobs", "options", "batched_rollout", "sft", "eval", "shard",
                 "memory", "checkpoints", "metrics", "lora", "rundir"},
}
BELOW_ENVS = ("toolcall", "muarl", "loss", "cli", "lora", "options", "models", "logprobs", "shard", "memory", "engine",
              "metrics", "stats", "opening", "decode")


def imports(path: str) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_imports_flow_one_way():
    files = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    files += sorted(os.path.join("envs", f) for f in os.listdir(os.path.join(ROOT, "envs")) if f.endswith(".py"))
    wrong = []
    for f in files:
        module = f.split(os.sep)[0].removesuffix(".py")
        assert module in ALLOWED, f"{f}: a new module; give it its place in ALLOWED (and in the README's file table)"
        project = imports(os.path.join(ROOT, f)) & set(ALLOWED)
        wrong += [f"{f} imports {m}" for m in sorted(project - ALLOWED[module] - {module})]
    assert not wrong, "imports against the layering: " + "; ".join(wrong)
    assert len(files) >= 10
    assert not [m for m in BELOW_ENVS if "envs" in ALLOWED[m]], "a module below envs/ may not import an environment"


def test_every_module_stays_under_its_line_budget():
    """One job per module, each readable in one sitting: at most ~400 lines."""
    files = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    files += [os.path.join("envs", f) for f in os.listdir(os.path.join(ROOT, "envs")) if f.endswith(".py")]
    lines = {f: len(open(os.path.join(ROOT, f)).read().splitlines()) for f in files}
    long = {f: n for f, n in lines.items() if n > 420}
    assert not long, f"modules over the ~400-line budget: {long}"


def test_the_check_sees_function_local_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\n\ndef f():\n    from grpo import token_logprobs\n    import sft.x\n")
    assert imports(str(p)) == {"os", "grpo", "sft"}


def test_docs_cite_what_exists():
    """Every test docs/invariants.md names exists; the code cites invariants 1-6 of that file only, and no document
    the repository does not hold; the README's metric table names exactly the metrics of metrics.METRICS; module
    lines are at most 120 characters."""
    import re

    import metrics

    text = open(os.path.join(ROOT, "docs", "invariants.md")).read()
    current = None
    for name in re.findall(r"`([^`]+)`", text):
        if name.startswith("tests/"):
            current, name = name.split("::")
        if current and re.fullmatch(r"test_\w+", name):
            assert f"def {name}(" in open(os.path.join(ROOT, current)).read(), f"{current}::{name}"
    modules = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    modules += [os.path.join("envs", f) for f in os.listdir(os.path.join(ROOT, "envs")) if f.endswith(".py")]
    for f in modules:
        src = open(os.path.join(ROOT, f)).read()
        assert "DESIGN.md" not in src, f
        for n in re.findall(r"invariants?\.md, (\d)", src) + re.findall(r"invariant (\d)", src):
            assert 1 <= int(n) <= 6 and f"## {n}." in text, (f, n)
        long = [i + 1 for i, line in enumerate(src.splitlines()) if len(line) > 120]
        assert not long, f"{f}: lines over 120 characters: {long}"
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("| metric | meaning |"):].split("\n\n")[0]
    named = {n for row in table.splitlines()[2:] for n in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert named - {"eval/before/pass1", "eval/after/pass1"} == set(metrics.METRICS)


def test_the_suite_runs_on_the_cpu():
    """tests/conftest.py hides the GPUs (CPU-calibrated tolerances; the GPU checks are bench/gpu.py's), so that
    `./run pytest` on a GPU machine tests what it tests here."""
    import torch

    if os.environ.get("MUARL_TESTS_ON_GPU") != "1":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()

"""The modules import one way, so a reader can start at the bottom and read up:

    envs/      the world: tasks, tools, databases, rewards, the episode rule, the simulated users
    loss.py    the GRPO math, pure functions on tensors
    cli.py     the entry points' plumbing: config dataclass as command line, Accelerator, atomic JSON
    shard.py   how the model is spread over GPUs: backends refused, the rollout's gathered weights, memory
    lora.py    LoRA adapters (peft): added, switched off for the reference, loaded, merged, checkpointed
    muarl.py   the floor of the agent's side: Episode, tokenization, tool-call format, model loading
    engine.py  batched decoding with each episode's KV cache kept across turns (torch and transformers only)
    rollout.py the agent playing episodes: the reference, and the episode loop over the engine
    sft.py, eval.py    cold start and evaluation, on the rollout
    metrics.py the names and meanings of what a run logs, and how micro-batches and processes combine them
    checkpoints.py     model directories and a GRPO run's checkpoints and directory (save, find, load, resume)
    grpo.py    the pipeline, on all of the above

Checked on the source (every import statement, function-local ones included), so a lazy import cannot hide a
dependency that runs later. muarl.py reads the shop domain (envs/shop.py) to train the tiny tokenizer on its text;
envs/ import nothing of the agent's side."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {  # module -> the project modules it may import
    "envs": {"envs"},
    "loss": set(),
    "cli": set(),
    "lora": set(),
    "muarl": {"envs", "cli", "lora"},
    "engine": set(),
    "rollout": {"envs", "muarl", "engine"},
    "sft": {"envs", "cli", "muarl", "loss", "rollout", "shard", "checkpoints", "lora"},
    "eval": {"envs", "cli", "muarl", "rollout", "shard", "checkpoints", "lora"},
    "shard": {"cli"},
    "metrics": set(),
    "checkpoints": {"cli", "shard", "lora"},
    "grpo": {"envs", "cli", "muarl", "loss", "rollout", "sft", "eval", "shard", "checkpoints", "metrics", "lora"},
}


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

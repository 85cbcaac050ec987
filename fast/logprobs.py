"""fast/logprobs.py: log p(token) of a causal LM for training, without ever holding a float32 [B, T, V] log-softmax.

    token_logprobs        per-token log-probs of a batch under a transformers causal LM (what the trainer and the
                          reference score; at the sampler's temperature)
    masked_token_entropy  the entropy metric of full logits under a mask
    logprobs_from_hidden  the output layer applied chunk by chunk, with a hand-written backward
    call_as_forward       how body and head run inside a wrapped (DDP) or sharded (FSDP2, ZeRO-3) model's forward

The plain twin it is held to (tests/test_grpo.py, bench/logprobs.py): log_softmax(model(ids).logits / temperature)
gathered at the next token. This module is machinery: the objective (loss.py) takes its output as a tensor.

Shapes: B rows, T tokens, V vocabulary, H hidden size.
"""
import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def masked_token_entropy(logits, mask, chunk_size=256):
    """Mean entropy (nats) of softmax(logits) over masked positions, a detached float32 0-dim tensor.
    logits: [B, T, V], mask: [B, T]; chunk_size rows at a time in float32 (extra memory O(chunk_size * V))."""
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        keep = mask.reshape(-1).bool()
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, flat.shape[0], chunk_size):
            z = flat[s:s + chunk_size].float()
            total += torch.where(keep[s:s + chunk_size], entropy_of_logits(z), 0.0).sum()
        return total / keep.sum().clamp(min=1)


def entropy_of_logits(z):
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
    when W or the compute dtype is bf16/fp16, accumulate_weight_grad, and under autocast one bf16 copy of h and
    of W). Cost: one
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
                    entropy[s:e] = entropy_of_logits(z)
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
                    accumulate_weight_grad(grad_w, dz, h)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


_FUSED = {}  # str(device) -> whether torch.addmm can accumulate a bf16/fp16 product into float32 there (CUDA)
GRAD_BLOCK = 1 << 24  # weights of the output layer's gradient updated per GEMM: bounds the transient of either path


def accumulate_weight_grad(grad_w, dz, h, block: int = GRAD_BLOCK) -> None:
    """grad_w += dz.T @ h, grad_w in float32, dz and h in the compute dtype, a block of vocabulary rows (~`block`
    weights) at a time. Where it runs (CUDA), a bf16/fp16 product accumulates straight into float32 in one GEMM a
    block (torch.addmm's out_dtype): the product is never rounded to the compute dtype, and nothing is allocated
    (on an H200 at Qwen3-8B's vocabulary and width: 0 MiB, max error 7e-8 against float32 arithmetic). Elsewhere the
    product is made in the compute dtype, cast and added: 6 bytes a weight of transient (3.7 GB for that head in one
    call; 96 MiB a block) and the rounding (max error 2e-4). The blocks bound that fallback's transient."""
    if dz.dtype == grad_w.dtype:
        grad_w.addmm_(dz.t(), h)
        return
    key, rows = str(grad_w.device), max(1, block // max(1, h.shape[1]))
    for s in range(0, grad_w.shape[0], rows):
        g, d = grad_w[s:s + rows], dz[:, s:s + rows].t()
        if _FUSED.get(key, grad_w.is_cuda):
            try:
                torch.addmm(g, d, h, out_dtype=g.dtype, out=g)
                _FUSED[key] = True
                continue
            except torch.OutOfMemoryError:
                raise  # not a missing kernel: the fallback would need more memory still
            except (RuntimeError, TypeError, NotImplementedError) as e:  # no such kernel in this torch or device
                _FUSED[key] = False
                if grad_w.is_cuda:  # expected on a CPU; on CUDA the one-GEMM path was the point: say it is off
                    warnings.warn(f"logprobs: the output layer's gradient falls back to cast-and-add on {key} "
                                  f"({e.__class__.__name__}: {str(e)[:200]})", stacklevel=2)
        g += torch.mm(d, h).float()


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
    check_plain_logits(model, inner)
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


def check_plain_logits(model, inner) -> None:
    """Refuse a model whose logits are not lm_head(hidden) (softcapped or scaled): the head here would miss it."""
    config = getattr(inner, "config", None)
    for attr, plain in (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0)):
        value = getattr(config, attr, plain)
        if value is not None and value != plain:
            raise NotImplementedError(f"{type(model).__name__} post-processes its logits "
                                      f"({attr}={value}); token_logprobs assumes logits = lm_head(hidden)")


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

"""fast/cuts.py: the decoding step's kernel cuts, exact rewrites of a model's own arithmetic that launch fewer kernels.

On a GPU a decoding step of a small batch is bound by the number of kernels it launches, not by their arithmetic:
graphed (graphs.py), each costs a few microseconds, ~40 a layer. While the engine decodes (`cut_kernels`, held
once a turn), every Llama-family RMSNorm is one call of torch's fused `rms_norm` and the weight's product (the module
launches 6-8 kernels), and the Llama-family rotary embedding rotates the queries and keys as one tensor with the
rotated half's sign carried by the sine (5 kernels where the model's launches 10), bitwise the model's numbers on
the CPU; the grouped attention makes its additive mask once a step (decode.py, through `once`). `ON` False is the
step as the model writes it (bench/gpu.py times both).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap

import torch

ON = True  # the cuts (False: the norms, rotary and mask as the model and SDPA make them; bench/gpu.py)


# Llama's RMSNorm forward (Qwen2's, Qwen3's, Mistral's copy it): only norms of this code are fused (not Gemma's 1 + w)
RMS_NORM_FORWARD = '''def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_HELD: dict[int, object] = {}  # the models whose kernels a cut_kernels holds cut now


@functools.cache
def _is_llama_norm(cls: type) -> bool:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward)) == RMS_NORM_FORWARD
    except (OSError, TypeError, IndexError):
        return False


def _fused_norm(norm):
    def forward(x: torch.Tensor) -> torch.Tensor:  # (under autocast rms_norm runs in float32: rounded as the module)
        return norm.weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
    return forward


# Llama's rotary embedding (Qwen2's, Qwen3's, Mistral's copy it): only a module whose apply_rotary_pos_emb and
# rotate_half are this code (their signatures and statements; docstrings and decorators aside) gets the cut
ROTARY = """def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
ROTATE_HALF = """def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
_ROTARY: dict[str, list] = {}  # module name -> [its own apply_rotary_pos_emb, how many holders have it cut]


def _written_as(fn, reference: str) -> bool:
    """Whether function `fn` is `reference`'s code: the same arguments and statements (its docstring aside)."""
    def core(f) -> tuple:
        return ast.dump(f.args), [ast.dump(s) for s in f.body[ast.get_docstring(f) is not None:]]
    try:
        mine = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    return isinstance(mine, ast.FunctionDef) and core(mine) == core(ast.parse(reference).body[0])


def _llama_rotary(module) -> bool:
    return _is_llama_rotary(getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None))


@functools.cache
def _is_llama_rotary(apply, rotate) -> bool:
    return _written_as(apply, ROTARY) and _written_as(rotate, ROTATE_HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """Llama's apply_rotary_pos_emb, bitwise, in 5 kernels instead of 10 (2 x neg, cat, mul, mul, add): the queries
    and keys rotated as one tensor (their heads concatenated), rotate_half's negation carried by the sine made once a
    step ((-x) * s == x * (-s) in floating point), its concatenation one roll. q [B, H, T, D], k [B, Hk, T, D]."""
    half = q.shape[-1] // 2
    signed = once((sin, "signed"), lambda: torch.cat((-sin[..., :half], sin[..., half:]), -1)).unsqueeze(1)
    qk = torch.cat((q, k), dim=1)
    out = (qk * cos.unsqueeze(1)) + (qk.roll(half, -1) * signed)
    return out[:, :q.shape[1]], out[:, q.shape[1]:]


def _rotary_for(name: str, q, k, cos, sin, unsqueeze_dim: int = 1):
    """`rotary` in place of module `name`'s apply_rotary_pos_emb; the module's own where the layout is another."""
    if q.dim() != 4 or k.dim() != 4 or unsqueeze_dim != 1 or q.dtype != k.dtype or q.shape[2:] != k.shape[2:]:
        return _ROTARY[name][0](q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return rotary(q, k, cos, sin)


@contextlib.contextmanager
def cut_kernels(model, on: bool = True):
    """While decoding, every RMSNorm of the model whose forward is RMS_NORM_FORWARD computed as one call of torch's
    rms_norm (normalized in float32, rounded to the input's dtype: one fused kernel on CUDA, where the module launches
    6-8) and the weight's product: bitwise the module's on the CPU; on CUDA the fused kernel sums the squares in its
    own order. A layer's four norms go from ~30 kernels to 8. And the model's rotary through `rotary` where its module
    writes Llama's (bitwise). Held once a turn by the engine (a call inside it does nothing); the modules' own
    forwards and functions are put back after."""
    mine = on and ON and id(model) not in _HELD
    norms = [m for m in model.modules() if _is_llama_norm(type(m)) and "forward" not in vars(m)] if mine else []
    names = sorted({type(m).__module__ for m in model.modules()}) if mine else []
    modules = [sys.modules[n] for n in names if n in sys.modules and (n in _ROTARY or _llama_rotary(sys.modules[n]))]
    _HELD.update({id(model): model} if mine else {})
    cut = []  # the modules whose rotary this call swapped (put back after, whatever raised)
    try:
        for m in norms:
            m.forward = _fused_norm(m)
        for module in modules:
            held = _ROTARY.setdefault(module.__name__, [module.apply_rotary_pos_emb, 0])
            held[1] += 1
            cut.append(module)
            module.apply_rotary_pos_emb = functools.partial(_rotary_for, module.__name__)
        yield
    finally:
        for m in norms:
            vars(m).pop("forward", None)
        for module in cut:
            held = _ROTARY[module.__name__]
            held[1] -= 1
            if not held[1]:
                module.apply_rotary_pos_emb = held[0]
                del _ROTARY[module.__name__]
        if mine:
            del _HELD[id(model)]


_ONCE: list = []  # (key, value) of the last few `once` calls, the most recently used last
ONCE_KEPT = 16


def once(key: tuple, make):
    """make(), made once for `key`, objects compared by identity: a decoding step hands every layer the same mask
    object, so what is made of it (the grouped attention's additive mask, the openings' masks and biases) is made
    at the first layer and read by the others. The ONCE_KEPT most recently used are kept (a step's masks, not a
    rollout's: what every layer reads stays, whatever a layer makes anew); a prefill's (a mask of several queries a
    row, key[0]) is made anew in every layer: large, and kept it would outlive its forward into the next chunk's."""
    if key[0].shape[-2] > 1:
        return make()
    for i, (k, value) in enumerate(_ONCE):
        if len(k) == len(key) and all(a is b for a, b in zip(k, key)):
            _ONCE.append(_ONCE.pop(i))
            return value
    value = make()
    _ONCE.append((key, value))
    del _ONCE[:-ONCE_KEPT]
    return value



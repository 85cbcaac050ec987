"""logprobs.shared_opening_logprobs: a GRPO group's opening computed once, its keys and values shared by every row's
remainder, against token_logprobs on the whole rows: the same log-probs and the same gradients, the opening's layers
trained through its keys and values alone."""
import copy

import pytest
import torch

import models
from conftest import TEST_CORPUS
from logprobs import shared_opening_logprobs, token_logprobs


@pytest.mark.versions
@pytest.mark.parametrize("arch, checkpointing, rows", [("llama", False, 3), ("qwen3", False, 8), ("llama", True, 3),
                                                       ("qwen3", True, 1)])
def test_the_opening_once_gives_the_log_probs_and_gradients_of_every_row_whole(arch, checkpointing, rows):
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    torch.manual_seed(0)
    cfg = models.tiny_config(len(tok), arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    whole = __import__("transformers").AutoModelForCausalLM.from_config(cfg).train()
    if checkpointing:  # transformers drops a cache under checkpointing unless the layer may keep it
        whole.gradient_checkpointing_enable()
    shared = copy.deepcopy(whole)
    g = torch.Generator().manual_seed(1)
    O, T = 11, 25
    opening = torch.randint(0, len(tok), (O,), generator=g)
    ids = torch.cat([opening.expand(rows, O), torch.randint(0, len(tok), (rows, T - O), generator=g)], 1)
    attn = torch.ones(rows, T, dtype=torch.long)
    attn[1:, 15 + torch.arange(rows - 1) % 9] = 0  # right padding of several lengths
    attn = attn.cummin(1).values
    mask = attn.clone()
    mask[:, :O] = 0  # the opening is never trained
    weights = torch.randn(rows, T, generator=g)
    a = token_logprobs(whole, ids, attn, temperature=0.7)
    (a * mask * weights).sum().backward()
    b = shared_opening_logprobs(shared, ids, attn, O, temperature=0.7)
    (b * mask * weights).sum().backward()
    assert ((a - b) * mask).abs().max() < 1e-5
    assert (b[:, :O] == 0).all()
    for (name, p), q in zip(whole.named_parameters(), shared.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    first = whole.model.layers[0].self_attn.k_proj.weight.grad
    assert first.abs().max() > 0  # the first layer's keys are trained, through the remainders' attention

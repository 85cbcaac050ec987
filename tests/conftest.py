import os
import sys

# Tests import the flat top-level modules (muarl, rollout, grpo, envs) from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# Text for the tests' tokenizer: small, fixed, enough to make BPE merges (any text still encodes byte-wise).
TEST_CORPUS = [
    "You are a customer service agent. Authenticate the user before anything else.",
    "Hi, I want to cancel my order. My email is ann@example.com. Which order? Order o123, yes please.",
    '{"name": "get_order", "arguments": {"order_id": "o123"}} {"status": "pending", "items": ["red mug"]}',
    "Thanks, that is all. ###STOP### Sorry, I could not find that order. Anything else?",
] * 20


@pytest.fixture(scope="session")
def tiny_tok():
    import muarl

    return muarl.tiny_tokenizer(TEST_CORPUS, vocab_size=512)


@pytest.fixture(scope="session")
def tiny_lm(tiny_tok):
    """A randomly initialized ~0.1M-parameter Qwen3 model over the test tokenizer (fp32, CPU, eval mode)."""
    import torch
    from transformers import Qwen3ForCausalLM

    import muarl

    torch.manual_seed(0)
    cfg = muarl.tiny_config(len(tiny_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            pad_token_id=tiny_tok.pad_token_id, eos_token_id=muarl.end_of_turn_id(tiny_tok))
    return Qwen3ForCausalLM(cfg).eval()

import os
import sys

# Tests import the flat top-level modules (muarl, rollout, grpo, envs) from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite runs on the CPU, where its tolerances were calibrated, even on a GPU machine: the GPU paths are
# bench/gpu.py's to check. MUARL_TESTS_ON_GPU=1 leaves the GPUs visible.
if os.environ.get("MUARL_TESTS_ON_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import copy  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from plumbing import models  # noqa: E402
import muarl  # noqa: E402

# Text for the tests' tokenizer: small, fixed, enough to make BPE merges (any text still encodes byte-wise).
TEST_CORPUS = [
    "You are a customer service agent. Authenticate the user before anything else.",
    "Hi, I want to cancel my order. My email is ann@example.com. Which order? Order o123, yes please.",
    '{"name": "get_order", "arguments": {"order_id": "o123"}} {"status": "pending", "items": ["red mug"]}',
    "Thanks, that is all. ###STOP### Sorry, I could not find that order. Anything else?",
] * 20


@pytest.fixture(scope="session")
def tiny_tok():
    # Whole-number tokens: the random-model fixtures below (turn lengths, end-of-turn rates) were calibrated on it.
    return models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)


@pytest.fixture(scope="session")
def tiny_lm(tiny_tok):
    """A randomly initialized ~0.1M-parameter Qwen3 model over the test tokenizer (fp32, CPU, eval mode)."""
    import torch
    from transformers import Qwen3ForCausalLM

    import muarl

    torch.manual_seed(0)
    cfg = models.tiny_config(len(tiny_tok), arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            pad_token_id=tiny_tok.pad_token_id, eos_token_id=muarl.end_of_turn_id(tiny_tok))
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def lm(tiny_tok):
    """tiny_lm's shape with larger random weights (initializer_range 0.3), ending its turns at ~20% of positions:
    its greedy text varies with the context instead of repeating one token, so greedy turns have different lengths
    and dialogues go several turns (the rollout tests)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = models.tiny_config(len(tiny_tok), arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
                            pad_token_id=tiny_tok.pad_token_id, eos_token_id=muarl.end_of_turn_id(tiny_tok))
    return chatty(Qwen3ForCausalLM(cfg).eval(), tiny_tok, rate=0.2)


def chatty(model, tokenizer, rate=0.15, seed=0):
    """A copy of a random model that ends its turn at roughly `rate` of positions (greedy), so conversations go
    several turns: the end-of-turn row of the output embedding is pushed along the mean hidden state."""
    model, eot = copy.deepcopy(model), muarl.end_of_turn_id(tokenizer)
    ids = torch.randint(0, len(tokenizer), (8, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        w = model.get_output_embeddings().weight
        logits = h @ w.T
        logits[:, eot] = -1e9
        u = h.mean(0)
        proj, best = h @ u / (u @ u), logits.max(-1).values
        lo, hi = -10.0, 10.0
        for _ in range(40):
            c = (lo + hi) / 2
            lo, hi = (c, hi) if ((h @ w[eot] + c * proj > best).float().mean() < rate) else (lo, c)
        w[eot] += c * u / (u @ u)
    return model


def ends_turns(model, tokenizer, gap=2.0, seed=0):
    """A copy of a random model whose end-of-turn logit sits `gap` above the average logit (measured over random
    tokens), so that *sampled* turns end early enough for dialogues to finish normally. After tests.fake_env's
    real openings, at temperature 1, gap 2.0 gives turns of 2 to ~45 tokens and mixed coin-flip rewards in a group
    of 4; gap 3.5 (the earlier default) gave the end-of-turn token at once in almost every turn, so groups were
    uniform and a training step had no advantage but by luck."""
    model, eot = copy.deepcopy(model), muarl.end_of_turn_id(tokenizer)
    ids = torch.randint(0, len(tokenizer), (8, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        w = model.get_output_embeddings().weight
        u = h.mean(0)
        now = (h @ w[eot] - (h @ w.T).mean(-1)).mean()
        w[eot] += (gap - now) * u / (u @ u) / (h @ u / (u @ u)).mean()
    return model


class ChatServer:
    """A real OpenAI-compatible HTTP endpoint on 127.0.0.1: POST /v1/chat/completions. `script` decides each
    answer: a function (request body, request number) -> (status, message dict), or (status, bytes) for a raw body
    that is not a chat completion (HTML, broken JSON), sent as it is, or (status, writer) where writer(handler) writes
    the headers and body itself (an endless body, a compressed one). `drip`: seconds between the bytes of a body
    (an endpoint that answers at once, then sends its reply a byte at a time). `headers`: each request's headers."""

    def __init__(self, script, drip: float = 0.0):
        self.requests, self.headers, self.script, lock = [], [], script, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append((self.path, body))
                    server.headers.append(dict(self.headers))
                    n = len(server.requests)
                status, message = server.script(body, n)
                if callable(message):
                    self.send_response(status)
                    try:
                        message(self)
                    except OSError:  # the client gave up
                        pass
                    return
                if isinstance(message, bytes):
                    self.send_response(status)
                    self.send_header("Content-Type", "text/html" if message.startswith(b"<") else "application/json")
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    self.send_body(message)
                    return
                payload = ({"id": f"c{n}", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                           if status == 200 else {"error": {"message": "boom", "type": "server_error"}})
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.send_body(data)

            def send_body(self, data):
                if not drip:
                    self.wfile.write(data)
                    return
                try:
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        time.sleep(drip)
                except OSError:  # the client gave up
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def bf16_accelerator():
    """An Accelerator with bf16 mixed precision on the CPU (CPU autocast runs bf16). Accelerate keeps one
    process-wide state and refuses a second precision, so the state is reset before and after."""
    from accelerate.state import AcceleratorState, GradientState

    from plumbing import cli

    threads = torch.get_num_threads()
    AcceleratorState._reset_state(True)
    acc = cli.make_accelerator(mixed_precision="bf16")
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def start_lm(tiny_tok, tiny_lm):
    """tiny_lm ending its sampled turns early enough for dialogues to finish normally (and be scored)."""
    return ends_turns(tiny_lm, tiny_tok)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory, tiny_tok, start_lm):
    """start_lm and the test tokenizer as a checkpoint directory (read only: the runs' --init-from)."""
    path = tmp_path_factory.mktemp("init")
    start_lm.save_pretrained(path)
    tiny_tok.save_pretrained(path)
    return path

"""envs/api_agent.py: an agent behind an OpenAI-compatible endpoint, for the text-level driver (`envs.play`): a
cold-start teacher (sft.py --teacher MODEL) or an API baseline (eval.py --agent openai:MODEL). It plays beside the
scripted experts, not with the trained policy; a failing endpoint is one error naming the model and the endpoint
(AgentError), and one that fails the first DEAD_AFTER episodes stops its driver.
"""
from __future__ import annotations

import os


# Episodes of an API agent (or its user) failing from the first: the endpoint is taken for dead, and eval.py and the
# cold start's synthesis stop, rather than paying the retries of every task left
DEAD_AFTER = 3


class AgentError(RuntimeError):
    """An API agent's endpoint failed (after the client's retries) or answered with what is not a chat completion:
    the episode's failure, its message naming the model and the endpoint."""


class OpenAIAgent:
    """An agent behind an OpenAI-compatible endpoint, for `play`: a cold-start teacher (sft.py) or an API baseline
    (eval.py). It plays beside the scripted experts, so it lives beside the driver, not with the trained policy.
    Each request may take `timeout` seconds a read and is retried `max_retries` times by the client (connection
    errors, timeouts, 408/409/429, 5xx); a failure after them, or a reply that is not a chat completion, raises
    AgentError naming the model and the endpoint."""

    def __init__(self, model: str, tools: list[dict], base_url: str = "", temperature: float = 0.0,
                 timeout: float = 600.0, max_retries: int = 3):
        from openai import OpenAI

        key = os.environ.get("OPENAI_API_KEY")
        if not key and not base_url:
            raise SystemExit(f"OpenAI-compatible agent {model!r}: OPENAI_API_KEY is not set, and no base URL names "
                             "another server (--agent-base-url, --teacher-base-url)")
        self.client = OpenAI(base_url=base_url or None, api_key=key or "EMPTY", max_retries=max_retries,
                             timeout=timeout)  # local servers take any key
        self.model, self.tools, self.temperature = model, tools, temperature
        self.where = f"agent {model!r} at {base_url or 'the OpenAI API'}"

    def act(self, messages: list[dict]) -> dict:
        import openai

        try:
            r = self.client.chat.completions.create(model=self.model, messages=messages, tools=self.tools or None,
                                                    temperature=self.temperature)
        except openai.OpenAIError as e:
            raise AgentError(f"{self.where} failed: {e.__class__.__name__}: {str(e)[:300]}") from None
        choices = getattr(r, "choices", None)
        if not choices or getattr(choices[0], "message", None) is None:  # an HTML page, no choices, ...
            raise AgentError(f"{self.where} answered with what is not a chat completion: {str(r)[:200]!r}")
        m = choices[0].message
        msg = {"role": "assistant", "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        return msg

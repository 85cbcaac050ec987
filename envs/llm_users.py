"""The LLM users: an OpenAI-compatible endpoint (`OpenAIUserSim`: GPT-4o in training, GPT-4.1 in evaluation, as the
paper; any local vLLM or SGLang server) and a local Hugging Face model (`HFUserSim`), behind the interface of
envs/users.py. They see the conversation from the user's side (roles flipped, the task's scenario as their system
prompt) and, in dual-control domains, call the user's own tools on the episode's environment session.
"""
from __future__ import annotations

import asyncio
import json
import os

from envs import message_history, user_speaks_next
from envs.users import UserSim, UserSimError, _ChatState, _chat_state, _flip_new, _Retries, _user_view, reply_problem


class OpenAIUserSim(UserSim):
    """An LLM user behind any OpenAI-compatible chat endpoint (the paper: GPT-4o for training, temperature 0).

    Retries timeouts, connection errors, 408/409/429, 5xx and replies that are not a usable chat completion (not
    JSON, no choices, a message that is no message, says nothing or is not text: envs.users.reply_problem) with
    exponential backoff (backoff * 2**attempt seconds), itself: the client's own retries are off so that the policy is
    visible here and testable. `timeout` bounds each request as a whole, reading the reply included (the client's own
    timeout is per read: an endpoint that drips its reply a byte at a time never trips it), so a call costs at most
    (max_retries + 1) * timeout seconds plus the backoff. After `max_retries` retries the episode ends as
    infra_error, with a message that names the endpoint and the options that set it."""

    RETRY_STATUS = {408, 409, 429}

    def __init__(self, model: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 temperature: float = 0.0, max_tokens: int | None = None, max_concurrency: int = 32,
                 max_retries: int = 5, backoff: float = 1.0, timeout: float = 60.0, max_tool_rounds: int = 10):
        self.model = model or os.environ.get("MUARL_USER_MODEL", "gpt-4o")
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # local servers ignore it
        self.temperature, self.max_tokens = temperature, max_tokens
        self.max_concurrency, self.max_retries, self.backoff, self.timeout = (
            max_concurrency, max_retries, backoff, timeout)
        self.max_tool_rounds = max_tool_rounds
        self._loop = None
        self.opening_retries: dict[str, int] = {}  # task id -> retried requests of its opening, until collected

    @property
    def name(self) -> str:
        """Which user simulator, for error messages: the model and the endpoint, and the options that set them."""
        where = self.base_url or "https://api.openai.com/v1 (OPENAI_BASE_URL unset)"
        return f"user simulator {self.model!r} at {where} (--user-model, --user-base-url; key: OPENAI_API_KEY)"

    def _client(self):
        # An async client (and semaphore) belongs to the event loop it first ran on; each rollout() is its own
        # asyncio.run, so make them per loop.
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            from openai import AsyncOpenAI

            self._openai = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                       timeout=self.timeout)
            self._sem, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._openai

    async def _complete(self, messages: list[dict], tools: list[dict], state=None):
        import openai

        client = self._client()
        kwargs = dict(model=self.model, messages=messages, temperature=self.temperature)
        if self.max_tokens:
            kwargs["max_tokens"] = self.max_tokens
        if tools:
            kwargs["tools"] = tools
        for attempt in range(self.max_retries + 1):
            try:
                async with self._sem, asyncio.timeout(self.timeout):  # its place in line is not counted
                    return await self._request(client, kwargs)
            except (openai.APIConnectionError, openai.APIStatusError) as e:  # timeouts are connection errors
                status = getattr(e, "status_code", None)
                retriable, error = status is None or status >= 500 or status in self.RETRY_STATUS, e
            except TimeoutError:
                retriable, error = True, TimeoutError(f"no whole reply within {self.timeout:g}s")
            except openai.OpenAIError as e:  # a request the client refuses to send: retrying cannot help
                raise UserSimError(f"{self.name} failed: {e!r}") from e
            except (ValueError, RecursionError) as e:  # not a chat completion (HTML, bad JSON, nested past the
                retriable, error = True, e                # parser's depth, no choices, no text)
            if state is not None and retriable and attempt < self.max_retries:
                state.retries += 1  # counted in the episode (Episode.user_retries) and the step's metrics
            if not retriable or attempt == self.max_retries:
                raise UserSimError(f"{self.name} failed after {attempt + 1} attempts "
                                   f"(--user-retries {self.max_retries}, --user-timeout {self.timeout:g}s): "
                                   f"{error!r}") from error
            await asyncio.sleep(self.backoff * 2 ** attempt)

    async def _request(self, client, kwargs: dict):
        """One request, the reply as a message with .content and .tool_calls: the one method a simulator that speaks
        another protocol replaces. Raise ValueError or TimeoutError for a failure worth retrying (with backoff, up to
        --user-retries), UserSimError for one that is not.

        The body is read as it streams in and refused past MAX_REPLY_BYTES (the client would hold all of it: an
        endless reply grew at ~350 MB/s until --user-timeout), asked uncompressed (a 200 KB gzip body decoded to 200
        MB), and parsed here as the client would, leniently (ChatCompletion.construct), for _usable_message to check."""
        from openai.types.chat import ChatCompletion

        body = bytearray()
        async with client.chat.completions.with_streaming_response.create(
                **kwargs, extra_headers={"Accept-Encoding": "identity"}) as response:
            async for chunk in response.iter_bytes():  # decoded chunk by chunk when a server compresses anyway
                body += chunk
                if len(body) > MAX_REPLY_BYTES:
                    raise MalformedReply(f"the reply's body passed {MAX_REPLY_BYTES:,} bytes (MAX_REPLY_BYTES), more "
                                         "than a chat completion a user says needs; not read further")
        data = json.loads(body)  # ValueError: not JSON; RecursionError: nested past the parser's depth
        if not isinstance(data, dict):
            raise MalformedReply(f"the reply is not a chat completion (a JSON {type(data).__name__}): "
                                 f"{bytes(body[:200])!r}")
        return _usable_message(ChatCompletion.construct(**data), "tools" in kwargs)

    async def aclose(self) -> None:
        if self._loop is asyncio.get_running_loop():
            await self._openai.close()
            self._loop = None

    async def opening(self, env, task) -> str | None:
        # Shared by the group before any session exists, so the opening runs no user tools.
        history = message_history(env, task)
        if not user_speaks_next(history):
            return None
        counter = _Retries()
        try:
            return (await self._complete(_user_view(task, history, bool(env.user_tools(task))), [], counter)).content
        finally:  # the rollout adds them to the group's first episode (opening_retries)
            self.opening_retries[task.id] = self.opening_retries.get(task.id, 0) + counter.retries

    def start(self, env, task, session, opening):
        return _chat_state(env, task, session, opening, env.user_tools(task))

    async def reply(self, state: _ChatState, messages):
        _flip_new(state, messages)
        for _ in range(self.max_tool_rounds + 1):
            msg = await self._complete(state.history, state.tools, state)
            if not (state.tools and msg.tool_calls):
                state.history.append({"role": "assistant", "content": msg.content or ""})
                return state.said(msg.content or "")
            # User-side tools (tau2 telecom): run them on the episode's session, loop until the user talks.
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in msg.tool_calls]
            state.history.append({"role": "assistant", "content": msg.content or "", "tool_calls": calls})
            for c in calls:
                try:
                    args = json.loads(c["function"]["arguments"] or "{}")
                except (ValueError, TypeError, RecursionError) as e:  # not JSON, a huge number, nested too deep
                    content = f"Error: arguments are not a JSON object: {e}"
                else:  # n_messages: the call's place in the conversation, just before this reply
                    content = state.session.call_tool(c["function"]["name"], args, requestor="user",
                                                      n_messages=len(messages)).content
                state.history.append({"role": "tool", "tool_call_id": c["id"], "content": content})
        raise UserSimError(f"user simulator made more than {self.max_tool_rounds} rounds of tool calls")


# The most bytes of a reply's body read (after any decoding): MAX_REPLY_CHARS of text, JSON-escaped (up to 6 bytes a
# character), with its tool calls and the completion's fields around it.
MAX_REPLY_BYTES = 4 * 2**20


class MalformedReply(ValueError):
    """The endpoint answered, but not with a message the user can say (retried like a 5xx)."""


def _usable_message(resp, tools_offered: bool):
    """The message of a chat completion, checked: it exists, and it says something (text fit for an episode:
    envs.users.reply_problem), unless it calls one of the user's tools. The client does not check the reply's shape (a
    `choices` that is an object or a number reaches here as it came), and an empty or null user message would otherwise
    enter the episode as a turn, scored and trained as if the user had said nothing."""
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise MalformedReply(f"the reply is not a chat completion with choices: {str(resp)[:200]!r}")
    msg = getattr(choices[0], "message", None)
    if msg is None or not hasattr(msg, "content"):
        raise MalformedReply(f"the reply's first choice has no message ({str(choices[0])[:200]!r})")
    calls = getattr(msg, "tool_calls", None)
    if tools_offered and calls:
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            raise MalformedReply(f"the reply's tool calls are not calls with an id, a function name and arguments: "
                                 f"{str(calls)[:200]!r}")
        return msg
    problem = reply_problem(msg.content)
    if problem:
        raise MalformedReply(f"the reply's message {problem}")
    return msg


def _is_call(c) -> bool:
    fn = getattr(c, "function", None)
    return (isinstance(getattr(c, "id", None), str) and isinstance(getattr(fn, "name", None), str)
            and isinstance(getattr(fn, "arguments", None), (str, type(None))))


class HFUserSim(UserSim):
    """A local transformers chat model as the user, for offline runs: plain HF generate over the flipped
    conversations of all waiting episodes in one left-padded batch. User-side tools are not supported.

    model, tokenizer: loaded (plumbing.users.make_user_sim("hf", model=NAME) loads one by name). end_of_turn: the
    token, or list of tokens, that end the user's message (default: the tokenizer's eos and every eos_token_id of the
    model's generation config, as Qwen3 lists two); template_kwargs: extra chat-template variables (Qwen3's
    enable_thinking=False).

    local: it computes on the agent's device, so the rollout asks it for every waiting reply in one batch, in the
    decoding thread, between decoding batches, instead of overlapping its replies with decoding."""

    local = True

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, temperature: float = 0.0,
                 end_of_turn: int | list[int] | None = None, template_kwargs: dict | None = None):
        self.model, self.tok = model.eval(), tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        if end_of_turn is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            end_of_turn = [t for t in dict.fromkeys([tokenizer.eos_token_id, *eos]) if t is not None]
        self.end_of_turn = end_of_turn
        self.template_kwargs = template_kwargs or {}

    def _generate(self, conversations: list[list[dict]]) -> list[str]:
        import torch

        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
                 for c in conversations]
        batch = self.tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        batch = batch.to(next(self.model.parameters()).device)
        sampling = dict(do_sample=True, temperature=self.temperature) if self.temperature > 0 else dict(do_sample=False)
        with torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=self.max_new_tokens, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=self.end_of_turn, **sampling)
        return [s.strip() for s in self.tok.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                                         skip_special_tokens=True)]

    async def opening(self, env, task) -> str | None:
        history = message_history(env, task)
        if not user_speaks_next(history):
            return None
        return self._generate([_user_view(task, history, False)])[0]

    def start(self, env, task, session, opening):
        if env.user_tools(task):
            raise NotImplementedError("the hf user simulator does not run user-side tools; use openai")
        return _chat_state(env, task, session, opening, [])

    async def replies(self, states, conversations):
        if not states:
            return []
        for s, m in zip(states, conversations):
            _flip_new(s, m)
        texts = self._generate([s.history for s in states])
        for s, t in zip(states, texts):
            s.history.append({"role": "assistant", "content": t})
        return [s.said(t) for s, t in zip(states, texts)]

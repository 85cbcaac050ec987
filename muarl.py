"""muarl.py: the episode in tokens, what MUA-RL trains on. The Episode record with its loss mask, the tokens that
end an agent turn, chat-template deltas, a finished conversation encoded the way a rollout builds it, and the padded
training batch. rollout.py plays episodes with it, sft.py and grpo.py train on them; the tool-call text format and
the tool-aware template it renders with are toolcall.py's.

Token in, token out (docs/invariants.md, 1). An episode is one growing list of token ids. The agent's turns enter it
verbatim as the ids the sampler produced (loss_mask 1). Everything else -- system prompt, user replies, tool
results, the generation prompt, the newline after an end-of-turn token -- enters as a chat-template *delta*
(loss_mask 0): the template renders a fixed base conversation with and without the new messages, and the
suffix is tokenized. A worked example with the ChatML tool template below, after the agent sampled
`<tool_call>...</tool_call><|im_end|>`:

    new messages = [{"role": "tool", "content": "{...}"}]
    delta text   = "\n<|im_start|>user\n<tool_response>\n{...}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                    ^ the newline the template puts after <|im_end|>, which the agent did not sample

Why a fixed base rather than the real history: some templates re-render old turns differently once the
conversation moves on (Qwen3 drops `<think>` blocks of turns before the last user message), so a render of
the real history is not always a prefix of the next render. The delta only depends on the new messages, and
the ids of earlier turns are never re-derived from text.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum

import torch

from toolcall import as_text, encode_text, format_assistant, render


# ---------------------------------------------------------------------------------------------------------
# The Episode record
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One multi-turn episode, token-exact.

    input_ids: [T]  the whole conversation as the policy saw and produced it
    loss_mask: [T]  1 on tokens the agent sampled (its text, tool-call text and end-of-turn token), else 0
    logprobs:  [T]  the sampler's log-probability of each sampled token (0.0 where loss_mask is 0)
    turn_spans:     each agent turn's [start, end) in input_ids, in order: one `append(..., agent=True)` a turn
    """

    task_id: str
    sample: int = 0  # index of this episode within its task's group
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # OpenAI format (see envs/__init__.py)
    tools: list[dict] = field(default_factory=list)
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)
    termination: str = ""  # why it ended: an envs.Termination ("" while it goes on)
    infra_failed: bool = False  # ended by an infrastructure failure: leave out of training, don't score as 0
    turns: int = 0  # agent messages
    tool_calls: Counter = field(default_factory=Counter)  # by tool name
    tool_errors: int = 0  # malformed calls, unknown tools, tools that raised
    gen_tokens: int = 0  # tokens the agent sampled
    user_seconds: list[float] = field(default_factory=list)  # how long each user reply took (all its retries)
    user_retries: int = 0  # requests to the user simulator's endpoint that were retried
    turn_spans: list[tuple[int, int]] = field(default_factory=list)

    def append(self, ids: list[int], agent: bool, logprobs: list[float] | None = None) -> None:
        """Append ids to the token stream: agent-sampled (trained on) or not."""
        self.input_ids.extend(ids)
        self.loss_mask.extend([1 if agent else 0] * len(ids))
        if agent:
            assert logprobs is not None and len(logprobs) == len(ids), "agent tokens need their sampler logprobs"
            self.turn_spans.append((len(self.input_ids) - len(ids), len(self.input_ids)))
            self.logprobs.extend(logprobs)
            self.gen_tokens += len(ids)
        else:
            self.logprobs.extend([0.0] * len(ids))

    def to_json(self, tokens: bool = False) -> dict:
        d = asdict(self)
        d["tool_calls"] = dict(self.tool_calls)
        if not tokens:
            for k in ("input_ids", "loss_mask", "logprobs", "turn_spans"):
                d.pop(k)
        return d


# ---------------------------------------------------------------------------------------------------------
# The turn's end
# ---------------------------------------------------------------------------------------------------------
def end_of_turn_id(tokenizer) -> int:
    """The token that ends an agent turn (the sampler stops on it and it is trained on)."""
    tok = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(tok, int) and tok != tokenizer.unk_token_id and tok is not None:
        return tok
    return tokenizer.eos_token_id


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends an agent turn: the end-of-turn token first, then each `eos_token_id` of the model's
    generation config (an int or a list; Qwen3's lists <|im_end|> and <|endoftext|>), as HF's generate stops on
    them. The one the sampler drew ends the turn, is kept verbatim and trained on, like the end-of-turn token."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys([end_of_turn_id(tokenizer), *eos]))


class TurnEnd(str, Enum):
    """Why the sampler stopped an agent turn (not why the episode ended: envs.Termination)."""
    EOT = "eot"                        # it drew one of stop_token_ids: the turn is whole
    MAX_NEW_TOKENS = "max_new_tokens"  # the per-turn cap cut it off
    CONTEXT = "context"                # the episode's context cap cut it off
    __str__, __format__ = str.__str__, str.__format__


# ---------------------------------------------------------------------------------------------------------
# Chat-template delta tokenization (docs/invariants.md, 1)
# ---------------------------------------------------------------------------------------------------------
_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def prompt_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    """Ids of the opening of an episode (system prompt with tools, the user's first message) plus the
    generation prompt. Nothing precedes it, so it is tokenized whole."""
    return encode_text(tokenizer, render(tokenizer, as_text(tokenizer, messages), as_text(tokenizer, tools),
                                         add_generation_prompt=True))


def after_turn_text(tokenizer) -> str:
    """What the template writes after an assistant's end-of-turn token (ChatML: a newline); cached."""
    cached = getattr(tokenizer, "_muarl_after_turn", None)
    if cached is None:
        eot = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
        text = render(tokenizer, _BASE + [{"role": "assistant", "content": "A"}])
        cached = text[text.rindex(eot) + len(eot):]
        tokenizer._muarl_after_turn = cached
    return cached


def closing_text(tokenizer) -> str:
    """What the template writes after an assistant message's content: its end-of-turn token, then
    after_turn_text (ChatML: "<|im_end|>\n"). Checked on a render, so a template that puts anything between the
    content and the end-of-turn token is refused rather than mis-tokenized."""
    eot = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    closing = eot + after_turn_text(tokenizer)
    text = render(tokenizer, _BASE + [{"role": "assistant", "content": "A"}])
    if not text.endswith("A" + closing):
        raise ValueError(f"chat template does not close an assistant message with {closing!r}: {text[-80:]!r}")
    return closing


def delta_ids(tokenizer, new_messages: list[dict], add_generation_prompt: bool = True,
              ended_with: int | None = None) -> list[int]:
    """Ids to append after an agent turn that ended on a stop token, for the non-agent messages that follow it
    (tool results, user replies), ending with the generation prompt for the agent's next turn.

    ended_with: the stop token the turn ended on (None: the end-of-turn token). A turn that ended on another stop
    token (Qwen3's <|endoftext|>, from its generation config) never wrote the template's end-of-turn token, so the
    delta starts with it (not trained): nothing the template writes is dropped, nothing the agent sampled is
    written twice, and the next turn reads the conversation as the template lays it out, with the sampled stop
    token inside the agent's turn:  ...Sure.<|endoftext|> | <|im_end|>\n<|im_start|>user\n...
    """
    assert new_messages and all(m["role"] != "assistant" for m in new_messages), "deltas carry no agent text"
    base = render(tokenizer, _BASE)
    full = render(tokenizer, _BASE + as_text(tokenizer, list(new_messages)),
                  add_generation_prompt=add_generation_prompt)
    if not full.startswith(base):
        raise ValueError("chat template is not prefix-stable for appended messages: "
                         f"{base[-80:]!r} is not a prefix of {full[:len(base) + 80]!r}")
    eot = end_of_turn_id(tokenizer)
    if ended_with is None or ended_with == eot:
        return encode_text(tokenizer, after_turn_text(tokenizer) + full[len(base):])
    ids = encode_text(tokenizer, closing_text(tokenizer) + full[len(base):])
    assert ids[0] == eot, "the end-of-turn token's text must encode to the end-of-turn token"
    return ids


def encode_conversation(tokenizer, messages: list[dict], tools=None, prompt_messages: int = 0
                        ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a finished conversation, built exactly as a rollout builds it: the opening,
    then each assistant message as its canonical text + end-of-turn (mask 1), then deltas (mask 0). Used for
    cold-start SFT so that SFT and RL train on identical token layouts. The first `prompt_messages` messages are
    prompt even where they are the assistant's (an earlier conversation the task continues): never trained on."""
    first_agent = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= prompt_messages), None)
    if first_agent is None:
        raise ValueError("conversation has no assistant message after its prompt")
    ep = Episode(task_id="")
    ep.append(prompt_ids(tokenizer, messages[:first_agent], tools), agent=False)
    eot = end_of_turn_id(tokenizer)
    i = first_agent
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            ids = encode_text(tokenizer, format_assistant(as_text(tokenizer, messages[i]))) + [eot]
            ep.append(ids, agent=True, logprobs=[0.0] * len(ids))
            i += 1
        else:
            j = i
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            ep.append(delta_ids(tokenizer, messages[i:j], add_generation_prompt=j < len(messages)), agent=False)
            i = j
    return ep.input_ids, ep.loss_mask


# ---------------------------------------------------------------------------------------------------------
# Episodes to a training batch
# ---------------------------------------------------------------------------------------------------------
def collate(seqs: list[tuple[list, ...]], pad_id: int, device=None):
    """Right-pad episodes given as (ids, loss_mask, *per-token floats) tuples, e.g. (ids, loss_mask, logprobs).
    Returns input_ids, attention_mask, loss_mask and each float row padded with 0: [B, T] each. The masks come from
    the sequences' lengths and the episodes' structure, never from token values (pad may equal eos)."""
    T = max(len(seq[0]) for seq in seqs)
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    floats = torch.zeros((len(seqs[0]) - 1, len(seqs), T), dtype=torch.float32)   # loss_mask, then the others
    for i, (ids, *rows) in enumerate(seqs):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
        for k, row in enumerate(rows):
            floats[k, i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return tuple(t.to(device) if device is not None else t for t in (input_ids, attention_mask, *floats))

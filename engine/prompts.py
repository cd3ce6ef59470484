"""Turning what a user wrote into prompt token ids that fit the model's context.

- a plain prompt is one user message; a system prompt is added only when one is given;
- the tokenizer's chat template renders the messages with `add_generation_prompt=True`, and `enable_thinking`
  is passed to templates that take it;
- a prompt that leaves no room for an answer is refused before any work with `PromptTooLongError`; a chat may
  instead drop its oldest turns (and says how many);
- `max_new_tokens` is clamped to the room left in the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .text_stream import THINK_CLOSE, THINK_OPEN

ROLES = ("system", "user", "assistant", "tool")


class PromptError(ValueError):
    """A prompt the engine cannot run; the message says what to change."""


class PromptTooLongError(PromptError):
    pass


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    max_new_tokens: int
    starts_in_reasoning: bool
    notices: tuple[str, ...] = ()


def normalize_messages(messages: object) -> list[dict]:
    """Check a messages list ({role, content} dicts) and return plain dicts; raise PromptError with the reason."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    normalized = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise PromptError(f"message {position} must be an object with 'role' and 'content', got {message!r:.80}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise PromptError(f"message {position} has role {role!r}; expected one of {', '.join(ROLES)}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise PromptError(f"message {position} content must be text, got {type(content).__name__}")
        normalized.append({"role": role, "content": content})
    if not any(m["role"] != "system" and m["content"].strip() for m in normalized):
        raise PromptError("the prompt is empty: there is no user message with text")
    return normalized


def build_messages(prompt: str | None = None, messages: Sequence[dict] | None = None,
                   system_prompt: str | None = None) -> list[dict]:
    """One list of messages from either a plain prompt or a messages list, with the optional system prompt first.

    A system prompt given here replaces a system message already at the head of `messages`.
    """
    if (prompt is None) == (messages is None):
        raise PromptError("give either a prompt or messages, not both")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("the prompt is empty")
        turns = [{"role": "user", "content": prompt}]
    else:
        turns = normalize_messages(messages)
    if system_prompt:
        turns = [m for m in turns[:1] if m["role"] != "system"] + turns[1:]
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def template_takes_thinking(tokenizer) -> bool:
    return "enable_thinking" in (getattr(tokenizer, "chat_template", None) or "")


def _render(tokenizer, messages: list[dict], enable_thinking: bool | None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template: use a chat/instruct model")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def _encode(tokenizer, text: str) -> list[int]:
    # The template already wrote the special tokens (BOS included where the model uses one).
    return tokenizer.encode(text, add_special_tokens=False)


def _opens_reasoning(rendered: str) -> bool:
    tail = rendered.rstrip()
    return tail.endswith(THINK_OPEN) and THINK_CLOSE not in tail[-len(THINK_OPEN) - 1:]


def _drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """Drop the oldest non-system turn (a user message and the replies up to the next user message)."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    body = messages[head:]
    user_positions = [i for i, m in enumerate(body) if m["role"] == "user"]
    if len(user_positions) < 2:
        return None
    return messages[:head] + body[user_positions[1]:]


def prepare_prompt(tokenizer, messages: list[dict], *, context_tokens: int, max_new_tokens: int,
                   enable_thinking: bool | None = None, drop_old_turns: bool = False) -> PreparedPrompt:
    """Render, tokenize and fit one prompt into `context_tokens`, clamping `max_new_tokens` to the room left."""
    notices: list[str] = []
    dropped = 0
    while True:
        rendered = _render(tokenizer, messages, enable_thinking)
        ids = _encode(tokenizer, rendered)
        fits = len(ids) + max_new_tokens <= context_tokens
        if fits or not drop_old_turns:
            break
        shorter = _drop_oldest_turn(messages)
        if shorter is None:
            break
        messages, dropped = shorter, dropped + 1
    if dropped:
        notices.append(f"Dropped the {dropped} oldest turn(s) of the conversation to fit the model's context of "
                       f"{context_tokens} tokens.")
    room = context_tokens - len(ids)
    if room < 1:
        raise PromptTooLongError(
            f"The prompt is {len(ids)} tokens long but the model's context holds {context_tokens} tokens in all "
            f"(prompt and answer): shorten the prompt by at least {len(ids) - context_tokens + 1} tokens.")
    if room < max_new_tokens:
        notices.append(f"max_new_tokens lowered from {max_new_tokens} to {room}: the context holds "
                       f"{context_tokens} tokens and the prompt takes {len(ids)}.")
    return PreparedPrompt(token_ids=ids, max_new_tokens=min(max_new_tokens, room),
                          starts_in_reasoning=_opens_reasoning(rendered), notices=tuple(notices))

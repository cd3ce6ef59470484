"""What crosses the engine's boundary on the way out: text deltas while streaming, one result at the end.

Only text and counts cross: token ids stay inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]
Channel = Literal["answer", "reasoning"]


@dataclass(frozen=True)
class StreamDelta:
    """A piece of new text. `channel` says whether it belongs to the model's reasoning or to its answer."""

    text: str
    channel: Channel = "answer"


@dataclass(frozen=True)
class GenerationResult:
    """The end of one request.

    Attributes:
        text: the answer, as `decode(ids, skip_special_tokens=True)` gives it, with the reasoning block and any
            stop string removed.
        finish_reason: `stop` (end of turn or a stop string), `length` (max_new_tokens), `cancelled`, `error`.
        prompt_tokens / completion_tokens: token counts (the completion includes the end-of-turn token).
        reasoning: the text inside `<think>...</think>` when the model thought, else None.
        error: what went wrong when finish_reason is `error`.
        notices: things the user should know, e.g. that old turns were dropped to fit the context.
        first_token_s / duration_s: seconds from submission to the first token and to the end.
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning: str | None = None
    error: str | None = None
    notices: tuple[str, ...] = ()
    first_token_s: float | None = None
    duration_s: float = 0.0
    request_id: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("stop", "length")

"""One request in flight: CB's cumulative outputs in, text events out on the request's own queue.

The engine's dispatcher thread calls `on_tokens` / `complete` / `fail` / `cancel`; whoever submitted the request
reads `StreamDelta`s and then one `GenerationResult` from `events` (see `RequestStream`). A handle ends exactly
once: later calls are ignored, so a cancel racing with a natural finish is harmless.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from .prompts import PreparedPrompt
from .results import FinishReason, GenerationResult, StreamDelta
from .text_stream import TextPipeline

logger = logging.getLogger(__name__)

# How long a reader waits on its queue before checking the engine is still alive.
POLL_INTERVAL_S = 0.5


class RequestHandle:
    def __init__(self, request_id: str, prompt: PreparedPrompt, pipeline: TextPipeline, eos_ids: set[int],
                 on_end: Callable[[RequestHandle], None] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.pipeline = pipeline
        self.eos_ids = eos_ids
        self.events: queue.Queue[StreamDelta | GenerationResult] = queue.Queue()
        self.result: GenerationResult | None = None
        self.tokens_seen = 0
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._on_end = on_end
        self._lock = threading.Lock()
        self.done = threading.Event()

    # --- called by the dispatcher -------------------------------------------------------------------------------

    def on_tokens(self, token_ids: list[int]) -> int:
        """A streaming update. Returns how many new tokens it carried."""
        new = self._count(token_ids)
        if not self.done.is_set():
            for delta in self.pipeline.push(token_ids):
                self.events.put(delta)
        return new

    @property
    def hit_stop_string(self) -> bool:
        return self.pipeline.stopped

    def complete(self, token_ids: list[int]) -> int:
        """The request ended in the scheduler (end of turn or max_new_tokens)."""
        new = self._count(token_ids)
        eos = bool(token_ids) and token_ids[-1] in self.eos_ids
        reason: FinishReason = "stop" if eos or self.pipeline.stopped else "length"
        self._end(reason, token_ids)
        return new

    def stop_at_string(self, token_ids: list[int]) -> None:
        """A stop string matched: the engine cancels the scheduler request and the answer ends before the match."""
        self._end("stop", token_ids)

    def fail(self, message: str, token_ids: list[int] | None = None) -> None:
        self._end("error", token_ids, error=message)

    def cancel(self) -> None:
        self._end("cancelled", None)

    # --- internals ----------------------------------------------------------------------------------------------

    def _count(self, token_ids: list[int]) -> int:
        new = len(token_ids) - self.tokens_seen
        if new > 0 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens_seen = max(self.tokens_seen, len(token_ids))
        return max(new, 0)

    def _end(self, reason: FinishReason, token_ids: list[int] | None, error: str | None = None) -> None:
        with self._lock:
            if self.done.is_set():
                return
            if token_ids is not None and reason != "error":
                for delta in self.pipeline.finish(token_ids):
                    self.events.put(delta)
            now = time.perf_counter()
            self.result = GenerationResult(
                text=self.pipeline.answer,
                finish_reason=reason,
                prompt_tokens=len(self.prompt.token_ids),
                completion_tokens=self.tokens_seen,
                reasoning=self.pipeline.reasoning if self.pipeline.splitter.saw_reasoning else None,
                error=error,
                notices=self.prompt.notices,
                first_token_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
                duration_s=now - self.submitted_at,
                request_id=self.request_id,
            )
            self.events.put(self.result)
            self.done.set()
        if self._on_end is not None:
            self._on_end(self)


class RequestStream:
    """Iterate to get `StreamDelta`s as they are generated; `result` holds the `GenerationResult` at the end.

    Closing the stream early (or leaving a `with` block) cancels the request and frees its KV-cache blocks.
    """

    def __init__(self, handle: RequestHandle, cancel: Callable[[str], None], health: Callable[[], str | None]) -> None:
        self._handle = handle
        self._cancel = cancel
        self._health = health
        self.result: GenerationResult | None = None

    @property
    def request_id(self) -> str:
        return self._handle.request_id

    @property
    def first_token_at(self) -> float | None:
        """`time.perf_counter()` when the engine received the first generated token (it may not be visible text
        yet: an incomplete character or a possible stop string is held back), or None before that."""
        return self._handle.first_token_at

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        if self.result is not None:
            raise StopIteration
        while True:
            try:
                event = self._handle.events.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                problem = self._health()  # the engine says why it cannot finish this request, if it cannot
                if problem is not None:
                    self._cancel(self.request_id)
                    self._handle.fail(f"The engine stopped serving this request: {problem}")
                continue
            if isinstance(event, GenerationResult):
                self.result = event
                raise StopIteration
            return event

    def wait(self) -> GenerationResult:
        """Consume the rest of the stream and return the result."""
        for _ in self:
            pass
        if self.result is None:
            raise RuntimeError(f"request {self.request_id} ended without a result")
        return self.result

    def cancel(self) -> None:
        if not self._handle.done.is_set():
            self._cancel(self.request_id)

    def close(self) -> None:
        self.cancel()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

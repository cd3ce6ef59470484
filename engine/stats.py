"""Engine statistics: a tokens-per-second meter over a sliding window, and the snapshot the UI shows."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


class ThroughputMeter:
    """Counts generated tokens and reports tokens/s over the last `window_s` seconds. Thread-safe."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.total_tokens = 0

    def add(self, tokens: int) -> None:
        if tokens <= 0:
            return
        now = self._clock()
        with self._lock:
            self._events.append((now, tokens))
            self.total_tokens += tokens
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0
            tokens = sum(count for _, count in self._events)
        return tokens / self.window_s


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for the UI and the logs."""

    model: str
    device: str
    dtype: str
    attention: str
    attention_reason: str
    is_random_model: bool
    running: bool
    active_requests: int  # handed to the scheduler and not finished
    queued_requests: int  # dataset rows waiting in the engine for a scheduler slot
    tokens_per_second: float
    total_tokens: int
    kv_cache_used: float | None  # fraction of KV-cache blocks in use, None before the first request
    kv_cache_gib: float
    max_batch_tokens: int
    restarts: int

    def as_markdown(self) -> str:
        cache = "n/a" if self.kv_cache_used is None else f"{self.kv_cache_used:.0%} of {self.kv_cache_gib:.2f} GiB"
        state = "running" if self.running else "idle"
        return (
            f"**Model** `{self.model}`{' (random weights: answers are meaningless)' if self.is_random_model else ''}  \n"
            f"**Device** {self.device} · **dtype** {self.dtype} · **attention** `{self.attention}`  \n"
            f"_{self.attention_reason}_  \n"
            f"**Loop** {state} · **active** {self.active_requests} · **queued** {self.queued_requests} · "
            f"**{self.tokens_per_second:.1f} tok/s** (last 10 s) · **KV cache** {cache} · "
            f"**batch tokens** {self.max_batch_tokens}"
        )

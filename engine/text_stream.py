"""From growing token lists to clean text deltas: incremental decoding, stop strings and the reasoning split.

Three small stages, each fed text and holding back only what it must:
- `IncrementalDetokenizer`: new token ids -> text, never emitting half a character (tokenizers' DecodeStream),
  and at the end reconciled with `decode(all_ids, skip_special_tokens=True)` so the deltas add up to exactly it;
- `StopStringMatcher`: holds back a possible stop-string prefix and reports the first full match;
- `ReasoningSplitter`: routes text inside `<think>...</think>` to the reasoning channel, the rest to the answer.

`TextPipeline` chains them for one request. Nothing here knows about threads, queues or the model.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .results import Channel, StreamDelta

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class IncrementalDetokenizer:
    """Decodes a request's tokens as they arrive; `text` is everything emitted so far."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._consumed = 0
        self.text = ""

    def push(self, all_token_ids: list[int]) -> str:
        """Take the cumulative token list (as CB streams it) and return the newly decodable text."""
        new_ids = all_token_ids[self._consumed:]
        self._consumed = len(all_token_ids)
        if not new_ids:
            return ""
        delta = self._stream.step(self._backend, new_ids) or ""
        self.text += delta
        return delta

    def finish(self, all_token_ids: list[int]) -> str:
        """Return the text still held back (e.g. an incomplete byte sequence), so deltas sum to the full decode."""
        delta = self.push(all_token_ids)
        full = self._tokenizer.decode(all_token_ids, skip_special_tokens=True)
        if full.startswith(self.text):
            delta += full[len(self.text):]
            self.text = full
        # else: never seen in practice (checked on random ids); the streamed text stays authoritative
        return delta


class StopStringMatcher:
    """Finds the first stop string in a stream of text, never letting text past it (or a prefix of it) out early."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Return the text that is safe to emit; after a match, the text before it and nothing more."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self._pending += text
        first = None
        for stop in self.stops:
            index = self._pending.find(stop)
            if index != -1 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            self.matched = first[1]
            safe, self._pending = self._pending[: first[0]], ""
            return safe
        cut = max(0, len(self._pending) - self._holdback)
        safe, self._pending = self._pending[:cut], self._pending[cut:]
        return safe

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return "" if self.matched is not None else rest


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningSplitter:
    """Splits `<think>reasoning</think>answer` as it streams. The answer's leading newlines are dropped.

    `starts_in_reasoning` is for templates that open the think block in the prompt itself.
    """

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.saw_reasoning = starts_in_reasoning
        self._pending = ""

    def push(self, text: str) -> list[StreamDelta]:
        self._pending += text
        out: list[StreamDelta] = []
        while self._pending:
            before = self._pending
            if self.state == "start":
                self._step_start()
            elif self.state == "reasoning":
                self._step_tagged(THINK_CLOSE, "reasoning", "after_reasoning", out)
            elif self.state == "after_reasoning":
                stripped = self._pending.lstrip("\n")
                self._pending = stripped
                if stripped:
                    self.state = "answer"
            else:
                out.append(StreamDelta(self._pending, "answer"))
                self._pending = ""
            if self._pending == before and self.state in ("start", "reasoning"):
                break  # waiting for more text to decide
        return out

    def _step_start(self) -> None:
        stripped = self._pending.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._pending = stripped[len(THINK_OPEN):]
            self.state = "reasoning"
            self.saw_reasoning = True
        elif THINK_OPEN.startswith(stripped):
            return  # could still become "<think>"
        else:
            self.state = "answer"

    def _step_tagged(self, tag: str, channel: Channel, next_state: str, out: list[StreamDelta]) -> None:
        index = self._pending.find(tag)
        if index != -1:
            if index:
                out.append(StreamDelta(self._pending[:index], channel))
            self._pending = self._pending[index + len(tag):]
            self.state = next_state
            return
        keep = _partial_tag_suffix(self._pending, tag)
        emit = self._pending[: len(self._pending) - keep]
        if emit:
            out.append(StreamDelta(emit, channel))
        self._pending = self._pending[len(self._pending) - keep:]

    def flush(self) -> list[StreamDelta]:
        rest, self._pending = self._pending, ""
        if not rest:
            return []
        if self.state == "reasoning":
            return [StreamDelta(rest, "reasoning")]
        if self.state == "after_reasoning":
            rest = rest.lstrip("\n")
        return [StreamDelta(rest, "answer")] if rest else []


class TextPipeline:
    """One request's text path: tokens -> detokenizer -> stop strings -> reasoning split -> deltas."""

    def __init__(self, tokenizer, stops: tuple[str, ...], starts_in_reasoning: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringMatcher(stops)
        self.splitter = ReasoningSplitter(starts_in_reasoning)
        self.answer = ""
        self.reasoning = ""

    @property
    def stopped(self) -> bool:
        return self.stops.matched is not None

    def _record(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        for delta in deltas:
            if delta.channel == "answer":
                self.answer += delta.text
            else:
                self.reasoning += delta.text
        return deltas

    def push(self, all_token_ids: list[int]) -> list[StreamDelta]:
        safe = self.stops.push(self.detokenizer.push(all_token_ids))
        return self._record(self.splitter.push(safe)) if safe else []

    def finish(self, all_token_ids: list[int]) -> list[StreamDelta]:
        """Flush everything held back; after a stop-string match only the text before it."""
        deltas: list[StreamDelta] = []
        if not self.stopped:
            tail = self.stops.push(self.detokenizer.finish(all_token_ids))
            tail += self.stops.flush()
            deltas += self.splitter.push(tail)
        deltas += self.splitter.flush()
        return self._record(deltas)

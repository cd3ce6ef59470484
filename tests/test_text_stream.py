"""Incremental decoding, stop strings and the reasoning split, fed real token ids from the tiny model's tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.text_stream import ReasoningSplitter, StopStringMatcher, TextPipeline


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _feed_one_by_one(pipeline, ids):
    deltas = []
    for end in range(1, len(ids) + 1):
        deltas += pipeline.push(ids[:end])  # cumulative, as CB streams it
    deltas += pipeline.finish(ids)
    return deltas


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Hi 😀 café 数据 🚀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # emoji and CJK really are several byte tokens here
    deltas = _feed_one_by_one(TextPipeline(tokenizer, ()), [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text


def test_reasoning_is_split_from_the_answer(tokenizer):
    ids = tokenizer.encode("<think>Let me think: 2+2.</think>\n\nIt is 4.", add_special_tokens=False)
    pipeline = TextPipeline(tokenizer, ())
    deltas = _feed_one_by_one(pipeline, ids)
    assert "".join(d.text for d in deltas if d.channel == "reasoning") == "Let me think: 2+2."
    assert "".join(d.text for d in deltas if d.channel == "answer") == "It is 4."
    assert pipeline.reasoning == "Let me think: 2+2." and pipeline.answer == "It is 4."


def test_reasoning_opened_by_the_prompt(tokenizer):
    ids = tokenizer.encode("thinking here</think>answer", add_special_tokens=False)
    pipeline = TextPipeline(tokenizer, (), starts_in_reasoning=True)
    _feed_one_by_one(pipeline, ids)
    assert (pipeline.reasoning, pipeline.answer) == ("thinking here", "answer")


def test_unfinished_reasoning_stays_reasoning():
    splitter = ReasoningSplitter()
    deltas = splitter.push("<think>still going</thi") + splitter.flush()
    assert [(d.channel, d.text) for d in deltas] == [("reasoning", "still going"), ("reasoning", "</thi")]


def test_text_without_think_tag_is_all_answer():
    splitter = ReasoningSplitter()
    deltas = splitter.push("  <thin") + splitter.push("g> is not a tag") + splitter.flush()
    assert "".join(d.text for d in deltas) == "  <thing> is not a tag"
    assert {d.channel for d in deltas} == {"answer"}


def test_stop_string_split_across_deltas():
    matcher = StopStringMatcher(("STOP", "###"))
    emitted = matcher.push("hello ST") + matcher.push("O") + matcher.push("P and more")
    assert emitted == "hello " and matcher.matched == "STOP"
    assert matcher.flush() == ""


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(("world", "lo"))
    assert matcher.push("hello world") == "hel" and matcher.matched == "lo"


def test_stop_prefix_that_never_completes_is_released():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.push("abc ST") == "abc" and matcher.flush() == " ST"


def test_stop_string_in_pipeline(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    pipeline = TextPipeline(tokenizer, ("three",))
    deltas = []
    for end in range(1, len(ids) + 1):
        deltas += pipeline.push(ids[:end])
        if pipeline.stopped:
            break
    deltas += pipeline.finish(ids[:end])
    assert "".join(d.text for d in deltas) == "one two " == pipeline.answer

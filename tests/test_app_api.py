"""The app launched for real on localhost (tiny model), called through gradio_client like any API user would."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from gradio_client import Client

from tests.conftest import greedy_reference


@pytest.fixture(scope="module")
def client(app_server):
    return Client(app_server, verbose=False)


def _expected_reply(engine, message: str, max_new_tokens: int) -> str:
    prompt_ids = engine.prepare(prompt=message).token_ids
    return engine.loaded.tokenizer.decode(greedy_reference(engine, prompt_ids, max_new_tokens),
                                          skip_special_tokens=True)


def test_eight_concurrent_chats_each_equal_their_greedy_reference(client, engine):
    messages = [f"concurrent question {i} " + "with more words " * i for i in range(8)]

    def ask(message):
        return client.predict(message=message, temperature=0.0, max_new_tokens=24, api_name="/chat")

    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(ask, messages))
    for message, reply in zip(messages, replies, strict=True):
        assert reply == _expected_reply(engine, message, 24)


def test_chat_streams_its_growth(client):
    job = client.submit(message="stream please", temperature=0.0, max_new_tokens=40, api_name="/chat")
    final = job.result()
    outputs = job.outputs()
    assert len(outputs) > 2 and outputs[-1] == final
    assert all(final.startswith(partial) for partial in outputs)


def test_only_message_is_required(client):
    assert isinstance(client.predict(message="defaults for everything else", api_name="/chat"), str)


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -5}, {"max_new_tokens": 0}])
def test_invalid_values_raise_to_the_client_and_the_app_keeps_serving(client, bad):
    with pytest.raises(Exception, match=next(iter(bad))):
        client.predict(message="hi", api_name="/chat", **bad)
    assert isinstance(client.predict(message="still there?", max_new_tokens=4, api_name="/chat"), str)


def test_over_long_prompt_is_a_clear_error(client):
    with pytest.raises(Exception, match="context"):
        client.predict(message="the " * 3000, api_name="/chat")


def test_dataset_job_through_the_api(client, engine):
    rows = [{"id": i, "question": f"dataset api question {i}", "note": "keep, me"} for i in range(6)]
    rows.append({"id": 6, "question": "", "note": "empty prompt"})
    output = client.predict(rows_jsonl="\n".join(json.dumps(r) for r in rows), prompt_column="question",
                            temperature=0.0, max_new_tokens=12, api_name="/generate_dataset")
    results = [json.loads(line) for line in output.splitlines()]
    assert [r["id"] for r in results] == list(range(7))
    assert all(r["note"] == src["note"] for r, src in zip(results, rows, strict=True))
    for row in results[:6]:
        assert row["response"] == _expected_reply(engine, row["question"], 12)
        assert row["error"] == ""
    assert results[6]["error"] and results[6]["response"] == ""


def test_dataset_api_unknown_column_is_a_clear_error(client):
    with pytest.raises(Exception, match="Columns: question"):
        client.predict(rows_jsonl='{"question": "x"}', prompt_column="missing", api_name="/generate_dataset")

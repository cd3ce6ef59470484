"""Interactive-first scheduling: waiting chat requests are prefilled before waiting dataset rows."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

from engine.scheduler import INTERACTIVE_PREFIX, SCHEDULER_NAME, InteractiveFirstScheduler, register_scheduler


def _scheduler_with_waiting(ids: list[str]) -> InteractiveFirstScheduler:
    scheduler = InteractiveFirstScheduler.__new__(InteractiveFirstScheduler)  # only the waiting queue is used here
    scheduler.waiting_requests = {i: SimpleNamespace(request_id=i, is_cpu_offloaded=False) for i in ids}
    scheduler.waiting_requests_order = deque(ids)
    return scheduler


def test_waiting_chats_go_alone_in_arrival_order():
    ids = ["row-1", "row-2", f"{INTERACTIVE_PREFIX}3", "row-4", f"{INTERACTIVE_PREFIX}5"]
    order = [s.request_id for s in _scheduler_with_waiting(ids)._get_waiting_candidates()]
    assert order == [f"{INTERACTIVE_PREFIX}3", f"{INTERACTIVE_PREFIX}5"]  # rows start their prefill next step


def test_rows_alone_keep_fifo_order():
    ids = ["row-3", "row-1", "row-2"]
    assert [s.request_id for s in _scheduler_with_waiting(ids)._get_waiting_candidates()] == ids


def test_registered_for_continuous_batching():
    assert register_scheduler() == SCHEDULER_NAME
    assert SCHEDULER_MAPPING[SCHEDULER_NAME] is InteractiveFirstScheduler


def _chat_during_job(engine, rows: int, prompt_words: int, row_tokens: int, chat_tokens: int):
    """Start a dataset job of `rows` rows, send one chat while it runs; return the chat's and the rows' results."""
    import threading

    from engine.config import SamplingParams
    from engine.engine import BatchRequest

    requests = [BatchRequest(key=i, prompt=f"row {i} " + "the " * prompt_words,
                             params=SamplingParams(temperature=0.0, max_new_tokens=row_tokens, ignore_eos=True))
                for i in range(rows)]
    results = []
    job = threading.Thread(target=lambda: results.extend(engine.generate_many(requests)))
    job.start()
    chat = engine.generate(prompt="a chat while the job runs",
                           params=SamplingParams(temperature=0.0, max_new_tokens=chat_tokens, ignore_eos=True))
    job.join(timeout=120)
    return chat, results


def test_chat_during_a_job_and_the_job_both_complete(engine):
    """On the real engine, with the scheduler's chat-only steps: a chat sent while a dataset job decodes gets its
    full answer, and every row of the job still gets all its tokens (the effect on latency is in bench.latency)."""
    chat, results = _chat_during_job(engine, rows=40, prompt_words=40, row_tokens=60, chat_tokens=8)
    assert chat.ok and chat.completion_tokens == 8
    assert len(results) == 40 and all(result.completion_tokens == 60 for _, result in results)


def test_while_a_chat_streams_dataset_rows_get_at_most_the_cap(engine, monkeypatch):
    """The engine's CPU default caps dataset tokens per step while a chat streams: every step holding the chat
    gives the rows at most the cap, and the rows still progress in those steps."""
    cap = engine.backend.dataset_tokens_while_chatting
    assert cap is not None and cap < engine.backend.max_batch_tokens  # the CPU default
    scheduler = engine._manager.batch_processor.scheduler
    steps: list[tuple[int, int]] = []  # (chat tokens, dataset tokens) of each step that holds a chat
    schedule = scheduler.schedule_batch

    def recording(*args, **kwargs):
        scheduled, *rest = schedule(*args, **kwargs)
        chat = sum(f.query_length for f in scheduled or () if f.state.request_id.startswith(INTERACTIVE_PREFIX))
        if chat:
            steps.append((chat, sum(f.query_length for f in scheduled) - chat))
        return (scheduled, *rest)

    monkeypatch.setattr(scheduler, "schedule_batch", recording)
    chat, results = _chat_during_job(engine, rows=48, prompt_words=60, row_tokens=40, chat_tokens=16)
    assert chat.completion_tokens == 16 and len(results) == 48
    assert steps and all(dataset <= cap for _, dataset in steps), steps
    assert any(dataset > 0 for _, dataset in steps)  # the job is slowed down, not stopped

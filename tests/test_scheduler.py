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


def test_waiting_chats_go_first_in_arrival_order():
    ids = ["row-1", "row-2", f"{INTERACTIVE_PREFIX}3", "row-4", f"{INTERACTIVE_PREFIX}5"]
    order = [s.request_id for s in _scheduler_with_waiting(ids)._get_waiting_candidates()]
    assert order == [f"{INTERACTIVE_PREFIX}3", f"{INTERACTIVE_PREFIX}5", "row-1", "row-2", "row-4"]


def test_rows_alone_keep_fifo_order():
    ids = ["row-3", "row-1", "row-2"]
    assert [s.request_id for s in _scheduler_with_waiting(ids)._get_waiting_candidates()] == ids


def test_registered_for_continuous_batching():
    assert register_scheduler() == SCHEDULER_NAME
    assert SCHEDULER_MAPPING[SCHEDULER_NAME] is InteractiveFirstScheduler

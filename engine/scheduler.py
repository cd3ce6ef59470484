"""Interactive-first scheduling: chat requests are prefilled before queued dataset rows.

transformers' FIFO scheduler serves, each step, the decoding requests first, then the prompts being prefilled, then
the waiting requests in arrival order. A chat message that arrives while a dataset job keeps rows waiting would be
prefilled after them. This scheduler keeps FIFO's rules but moves waiting *interactive* requests (the engine gives
them ids starting with `INTERACTIVE_PREFIX`) to the front of the waiting queue. Dataset rows are still admitted
through the engine's bounded slots, so the waiting queue stays short either way.

It is registered in transformers' `SCHEDULER_MAPPING` under `SCHEDULER_NAME` and chosen with
`ContinuousBatchingConfig(scheduler_type=SCHEDULER_NAME)`.
"""

from __future__ import annotations

from transformers.generation.continuous_batching import scheduler as cb_scheduler

SCHEDULER_NAME = "cbs_interactive_first"
INTERACTIVE_PREFIX = "chat-"


class InteractiveFirstScheduler(cb_scheduler.FIFOScheduler):
    def _get_waiting_candidates(self):
        candidates = super()._get_waiting_candidates()
        interactive = [state for state in candidates if state.request_id.startswith(INTERACTIVE_PREFIX)]
        if not interactive:
            return candidates
        return interactive + [state for state in candidates if not state.request_id.startswith(INTERACTIVE_PREFIX)]


def register_scheduler() -> str:
    """Make the scheduler available to CB (idempotent) and return its name."""
    cb_scheduler.SCHEDULER_MAPPING.setdefault(SCHEDULER_NAME, InteractiveFirstScheduler)
    return SCHEDULER_NAME

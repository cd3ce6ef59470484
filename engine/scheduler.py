"""Interactive-first scheduling: chat requests are prefilled before queued dataset rows.

transformers' FIFO scheduler serves, each step, the decoding requests first, then the prompts being prefilled, then
the waiting requests in arrival order. A chat message that arrives while a dataset job keeps rows waiting would be
prefilled after them, in a step as long as the whole batch makes it. This scheduler keeps FIFO's rules, except
that when *interactive* requests wait (the engine gives them ids starting with `INTERACTIVE_PREFIX`), the next step
holds only interactive requests: the chat's prefill runs in a short step of its own and its first token comes out
of it. Dataset rows lose one step per arriving chat message.

While a chat streams its answer, its tokens go first in every step, and dataset rows get at most
`dataset_tokens_while_chatting` tokens of the step (None: no cap). Where a step's cost grows with its tokens (CPU),
that keeps the chat streaming at close to its idle speed instead of at the speed of full dataset steps; the job
slows down only while a chat streams. The engine sets the cap per backend (engine.backend).

`schedule_batch` follows transformers 5.24's `FIFOScheduler.schedule_batch` line for line apart from that filter.

It is registered in transformers' `SCHEDULER_MAPPING` under `SCHEDULER_NAME` and chosen with
`ContinuousBatchingConfig(scheduler_type=SCHEDULER_NAME)`.
"""

from __future__ import annotations

from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.continuous_batching.requests import RequestStatus

SCHEDULER_NAME = "cbs_interactive_first"
INTERACTIVE_PREFIX = "chat-"


def _is_interactive(request_id: str) -> bool:
    return request_id.startswith(INTERACTIVE_PREFIX)


class InteractiveFirstScheduler(cb_scheduler.FIFOScheduler):
    dataset_tokens_while_chatting: int | None = None  # set by the engine on its instance

    def _get_waiting_candidates(self):
        candidates = super()._get_waiting_candidates()
        interactive = [state for state in candidates if _is_interactive(state.request_id)]
        # While a chat waits, no dataset row starts its prefill in this step.
        return interactive or candidates

    def schedule_batch(self, token_budget: int, cache_budget: int):
        """FIFO's `schedule_batch`, except that a step that admits a waiting chat holds only chat requests, and that
        dataset rows are capped while a chat streams."""
        chat_waiting = any(_is_interactive(request_id) for request_id in self.waiting_requests)
        decoding, prefilling = [], []
        for state in self.active_requests.values():
            if chat_waiting and not _is_interactive(state.request_id):
                continue  # dataset rows skip this one short step: the chat's first token comes out of it
            if state.status == RequestStatus.DECODING:
                decoding.append(state)
            elif state.status == RequestStatus.PREFILLING:
                prefilling.append(state)
        if not self.block_new_requests:
            prefilling.extend(self._get_waiting_candidates())
        candidates = decoding + prefilling
        cap = self.dataset_tokens_while_chatting
        if cap is not None and not chat_waiting:
            chats = [state for state in candidates if _is_interactive(state.request_id)]
            if chats:  # chats first with all the tokens they need, then dataset rows within the cap
                chat_tokens = sum(1 if state.status == RequestStatus.DECODING else len(state.remaining_prefill_tokens)
                                  for state in chats)
                token_budget = min(token_budget, chat_tokens + cap)
                candidates = chats + [state for state in candidates if not _is_interactive(state.request_id)]
        removed_from_waiting: set[str] = set()
        scheduled, one_allocation_failed, decode_fast_path, num_q_tokens, max_kv_read = self._process_candidates(
            candidates, token_budget, cache_budget, removed_from_waiting)
        self._cleanup_waiting_queue(removed_from_waiting)
        if not scheduled and one_allocation_failed:
            return None, decode_fast_path, 0, 0
        return scheduled, decode_fast_path, num_q_tokens, max_kv_read


def register_scheduler() -> str:
    """Make the scheduler available to CB (idempotent) and return its name."""
    cb_scheduler.SCHEDULER_MAPPING.setdefault(SCHEDULER_NAME, InteractiveFirstScheduler)
    return SCHEDULER_NAME

"""The process-wide engine: one model, one KV cache, one continuous-batching loop for chat, datasets and the CLI.

`Engine` owns the model, the tokenizer and transformers' `ContinuousBatchingManager` (whose background thread runs
every forward pass). Exactly one dispatcher thread consumes the manager's shared output queue and routes each
output to its request's own queue (`engine.request`), so no reader ever competes for that queue (transformers
#42943). Text goes in and text comes out: prompts are tokenized here and answers decoded here.

What it adds on top of CB: per-request sampling and seeds (engine.sampling), stop strings, reasoning split and
incremental decoding (engine.text_stream), context checks (engine.prompts), cancellation that ends the stream at
once (CB sends no final output for a cancelled request), bounded admission of dataset rows so chat requests are
scheduled ahead of a long job's queue, and recovery: if the loop thread dies, pending requests end with `error`
and the next request builds a new manager.

What it does not do: load data files or write results (engine.batch_job), or any UI (app.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .allocator import keep_freed_buffers
from .backend import PER_REQUEST_ATTENTION, BackendChoice, DeviceFacts, probe_device_facts, select_backend
from .config import EngineConfig, SamplingParams
from .loader import LoadedModel, inspect_checkpoint, load_model
from .prompts import PreparedPrompt, PromptError, build_messages, prepare_prompt, template_takes_thinking
from .request import POLL_INTERVAL_S, RequestHandle, RequestStream
from .results import GenerationResult
from .stats import EngineStats, ThroughputMeter
from .text_stream import TextPipeline

logger = logging.getLogger(__name__)

GIB = 1024**3
STALL_TIMEOUT_S = 300.0  # a loop that makes no step this long while requests wait is reported as hung


@dataclass(frozen=True)
class BatchRequest:
    """One dataset row (or one of its N generations) for `Engine.generate_many`."""

    key: object
    prompt: str | None = None
    messages: list[dict] | None = None
    system_prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    enable_thinking: bool | None = None


@dataclass(frozen=True)
class _ResolvedSampling:
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool


class Engine:
    """See the module docstring. Build with a config, then `start()` (loads the model); or use `get_engine()`."""

    def __init__(self, config: EngineConfig, facts: DeviceFacts | None = None) -> None:
        self.config = config
        self._facts = facts
        self.backend: BackendChoice | None = None
        self.loaded: LoadedModel | None = None
        self.attention_in_use: str | None = None
        self._cache_plan = None
        self._eos_ids: list[int] = []
        self.default_sampling = SamplingParams()
        self._manager = None
        self._manager_epoch = 0
        self._manager_lock = threading.RLock()
        self._handles: dict[str, tuple[int, RequestHandle]] = {}
        self._handles_lock = threading.Lock()
        self._ids = itertools.count()
        self._meter = ThroughputMeter()
        self._batch_slots: threading.BoundedSemaphore | None = None
        self._rows_waiting = 0
        self._rows_lock = threading.Lock()
        self._dispatcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._manager_ready = threading.Event()
        self._restarts = 0
        self._step_seen = (0, time.monotonic())

    # ----------------------------------------------------------------------------------------------- lifecycle --

    def start(self) -> Engine:
        """Choose the backend, load the model, start the loop and the dispatcher. Idempotent."""
        if self.loaded is not None:
            return self
        facts = self._facts or probe_device_facts()
        checkpoint = inspect_checkpoint(self.config)
        self.backend = select_backend(self.config, facts, checkpoint.dtype)
        logger.info(self.backend.summary())
        if self.backend.tune_cpu_allocator:
            keep_freed_buffers()
        self.loaded = load_model(self.config, self.backend, checkpoint)
        self._read_model_facts(facts)
        self._batch_slots = threading.BoundedSemaphore(self.backend.max_batch_inflight)
        with self._manager_lock:
            self._ensure_manager()
        self._dispatcher = threading.Thread(target=self._dispatch_forever, name="cb-dispatcher", daemon=True)
        self._dispatcher.start()
        return self

    def _read_model_facts(self, facts: DeviceFacts) -> None:
        import torch

        from .kv_cache import attention_needs_mask, plan_kv_cache

        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        budget = self.backend.kv_cache_bytes
        if budget is None:
            free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else facts.ram_available_bytes
            budget = int(free * self.backend.kv_cache_fraction)
        attention = self.backend.attn_implementation
        self._cache_plan = plan_kv_cache(
            model.config.get_text_config(), model.dtype.itemsize, budget, self.backend.page_size,
            self.backend.max_batch_tokens, attention_has_mask=attention_needs_mask(attention),
            flash_like="flash" in attention, max_inflight=self.backend.max_batch_inflight)
        self._log_cache_plan()

        generation_config = model.generation_config
        eos = generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        self._eos_ids = eos_ids
        sampling = bool(generation_config.do_sample)
        self.default_sampling = SamplingParams(
            temperature=float(generation_config.temperature or 1.0) if sampling else 0.0,
            top_p=float(generation_config.top_p or 1.0) if sampling else 1.0,
            top_k=int(generation_config.top_k or 0) if sampling else 0,
            max_new_tokens=self.config.max_new_tokens,
        )

    def _log_cache_plan(self) -> None:
        plan = self._cache_plan
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %.3f GiB with the tensors that scale with it "
                    "(%s); longest request %d tokens", plan.num_blocks, plan.page_size, plan.cache_tokens,
                    plan.bytes_total / GIB, self.backend.reasons["kv_cache"], plan.context_tokens)

    @property
    def context_tokens(self) -> int:
        """The longest prompt plus answer one request may have (the model's context, or the cache if smaller)."""
        return self._cache_plan.context_tokens if self._cache_plan else 0

    @property
    def kv_cache_bytes(self) -> int:
        return self._cache_plan.bytes_total if self._cache_plan else 0

    def _build_manager(self):
        from transformers import ContinuousBatchingConfig

        from .paged_reads import install_paged_reads
        from .sampling import install_sampler
        from .scheduler import InteractiveFirstScheduler, register_scheduler

        model = self.loaded.model
        generation_config = copy.deepcopy(model.generation_config)
        generation_config.do_sample = False  # our sampler picks every token; CB's argmax takes its one-hot row
        generation_config.temperature = generation_config.top_p = generation_config.top_k = None
        generation_config.num_return_sequences = 1
        generation_config.max_new_tokens = self.config.max_new_tokens
        generation_config.eos_token_id = self._eos_ids or None
        cb_config = ContinuousBatchingConfig(
            num_blocks=self._cache_plan.num_blocks,
            max_batch_tokens=self.backend.max_batch_tokens,
            page_size=self.backend.page_size,
            # Our per-request attention reads lengths on the host: it cannot be captured in a CUDA graph.
            use_cuda_graph=False if self.backend.attn_implementation == PER_REQUEST_ATTENTION
            else self.config.use_cuda_graph,
            # An explicit choice of sdpa means the stock path: do not let CB swap it for flash behind our back.
            auto_switch_to_flash=self.config.attn_implementation == "auto",
            scheduler_type=register_scheduler(),  # chat requests are prefilled ahead of waiting dataset rows
        )
        manager = model.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb_config)
        install_sampler(manager)
        try:
            manager.warmup()  # builds the cache here, so a bad size fails now and loudly, not in the loop thread
        except MemoryError as error:
            # CB also reserves activation memory that depends on the model; halve the cache until it fits.
            # (The manager was never started, so there is no thread to stop.)
            if self._cache_plan.num_blocks <= 2:
                raise
            logger.warning("%s: halving the KV cache", error)
            self._cache_plan = self._cache_plan.shrunk(0.5)
            self._log_cache_plan()
            return self._build_manager()
        if model.config._attn_implementation == PER_REQUEST_ATTENTION:
            install_paged_reads(manager.batch_processor.cache)  # attention reads the cache, not CB's copy of it
        scheduler = manager.batch_processor.scheduler
        if isinstance(scheduler, InteractiveFirstScheduler):
            scheduler.dataset_tokens_while_chatting = self.backend.dataset_tokens_while_chatting
        manager.start()
        self.attention_in_use = model.config._attn_implementation
        return manager

    def _ensure_manager(self):
        """Return a running manager, building a new one if there is none or the old one died. Call with the lock."""
        manager = self._manager
        if manager is not None and manager.is_running():
            return manager
        if manager is not None:
            self._retire_manager(manager, "The generation loop stopped unexpectedly")
        if self._manager_epoch > 0:
            self._restarts += 1
            logger.warning("Rebuilding the continuous-batching manager (restart %d)", self._restarts)
        self._manager = self._build_manager()
        self._manager_epoch += 1
        self._step_seen = (0, time.monotonic())
        logger.info("Continuous batching running: attention in use %s", self.attention_in_use)
        self._manager_ready.set()
        return self._manager

    def _retire_manager(self, manager, reason: str) -> None:
        """Fail every request of a dead manager and release it. Call with the manager lock held."""
        fatal = getattr(manager.background_thread_status, "fatal_error", None)
        message = f"{reason}: {fatal}" if fatal is not None else reason
        epoch = self._manager_epoch
        with self._handles_lock:
            orphans = [handle for handle_epoch, handle in self._handles.values() if handle_epoch == epoch]
        for handle in orphans:
            handle.fail(message)
        if self._manager is manager:
            self._manager = None
            self._manager_ready.clear()
        try:
            manager.stop(block=True, timeout=5)
        except Exception:  # the loop is already dead; stopping only tidies up, so log and go on
            logger.exception("Error while stopping a dead continuous-batching manager")

    def shutdown(self) -> None:
        """Cancel everything, stop the loop and the dispatcher."""
        self._closing.set()
        with self._handles_lock:
            handles = [handle for _, handle in self._handles.values()]
        for handle in handles:
            handle.fail("The engine was shut down")
        with self._manager_lock:
            if self._manager is not None:
                self._manager.stop(block=True, timeout=10)
                self._manager = None
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)

    # ---------------------------------------------------------------------------------------------- dispatcher --

    def _dispatch_forever(self) -> None:
        while not self._closing.is_set():
            manager = self._manager
            if manager is None:
                self._manager_ready.wait(timeout=POLL_INTERVAL_S)
                continue
            output = manager.get_result(timeout=POLL_INTERVAL_S)
            if output is not None:
                self._route(manager, output)
            elif not manager.is_running() and not self._closing.is_set():
                with self._manager_lock:
                    if self._manager is manager:
                        self._retire_manager(manager, "The generation loop stopped")

    def _route(self, manager, output) -> None:
        with self._handles_lock:
            entry = self._handles.get(output.request_id)
        if entry is None:
            return  # cancelled or stopped already: a late output
        handle = entry[1]
        tokens = list(output.generated_tokens)
        if output.error is not None:
            handle.fail(f"Generation failed: {output.error}", tokens)
        elif output.is_finished():
            self._meter.add(handle.complete(tokens))
        else:
            self._meter.add(handle.on_tokens(tokens))
            if handle.hit_stop_string:
                manager.cancel_request(handle.request_id)  # frees its KV blocks; CB sends nothing more
                handle.stop_at_string(tokens)

    def _forget(self, handle: RequestHandle) -> None:
        with self._handles_lock:
            self._handles.pop(handle.request_id, None)

    def health(self) -> str | None:
        """Why requests cannot make progress, or None when all is well."""
        if self._closing.is_set():
            return "the engine was shut down"
        if self._dispatcher is None or not self._dispatcher.is_alive():
            return "the engine's dispatcher thread is not running"
        manager = self._manager
        if manager is None:
            return None  # between a crash and the rebuild: the dispatcher fails pending requests itself
        step = getattr(manager, "current_batch", 0)
        seen_step, seen_at = self._step_seen
        now = time.monotonic()
        if step != seen_step:
            self._step_seen = (step, now)
        elif now - seen_at > STALL_TIMEOUT_S and self._handles:
            return f"the generation loop made no step in {STALL_TIMEOUT_S:.0f}s"
        return None

    # ------------------------------------------------------------------------------------------------- requests --

    def _resolve(self, params: SamplingParams) -> _ResolvedSampling:
        default = self.default_sampling

        def pick(name):
            value = getattr(params, name)
            return getattr(default, name) if value is None else value

        return _ResolvedSampling(temperature=pick("temperature"), top_k=pick("top_k"), top_p=pick("top_p"),
                                 max_new_tokens=pick("max_new_tokens") or self.config.max_new_tokens,
                                 stop=params.stop, seed=params.seed, ignore_eos=params.ignore_eos)

    def prepare(self, *, prompt: str | None = None, messages: list[dict] | None = None,
                system_prompt: str | None = None, enable_thinking: bool | None = None,
                max_new_tokens: int | None = None, drop_old_turns: bool = False) -> PreparedPrompt:
        """Render and check a prompt without running it (raises PromptError with the reason)."""
        self._require_started()
        turns = build_messages(prompt=prompt, messages=messages, system_prompt=system_prompt)
        return prepare_prompt(self.loaded.tokenizer, turns, context_tokens=self.context_tokens,
                              max_new_tokens=max_new_tokens or self.config.max_new_tokens,
                              enable_thinking=enable_thinking, drop_old_turns=drop_old_turns)

    def _submit(self, prepared: PreparedPrompt, sampling: _ResolvedSampling, streaming: bool,
                on_end=None, interactive: bool = True) -> RequestHandle:
        from .sampling import sampling_kwargs
        from .scheduler import INTERACTIVE_PREFIX

        # The id tells the scheduler (engine.scheduler) whether this is a chat request or a dataset row.
        request_id = f"{INTERACTIVE_PREFIX if interactive else 'row-'}{next(self._ids)}"

        def end(handle: RequestHandle) -> None:
            self._forget(handle)
            if on_end is not None:
                on_end(handle)

        pipeline = TextPipeline(self.loaded.tokenizer, sampling.stop, prepared.starts_in_reasoning)
        handle = RequestHandle(request_id, prepared, pipeline, set(self._eos_ids), on_end=end)
        kwargs = sampling_kwargs(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        for attempt in range(2):
            with self._manager_lock:
                manager = self._ensure_manager()
                with self._handles_lock:
                    self._handles[request_id] = (self._manager_epoch, handle)
                accepted = manager.add_request(
                    prepared.token_ids, request_id=request_id, max_new_tokens=prepared.max_new_tokens,
                    streaming=streaming or bool(sampling.stop),
                    eos_token_id=-1 if sampling.ignore_eos or not self._eos_ids else self._eos_ids, **kwargs)
            if accepted is not None:
                return handle
            logger.warning("The generation loop refused request %s (attempt %d); rebuilding", request_id, attempt + 1)
            with self._handles_lock:
                self._handles.pop(request_id, None)
        handle.fail("The generation loop could not accept the request")
        return handle

    def stream(self, *, prompt: str | None = None, messages: list[dict] | None = None,
               system_prompt: str | None = None, params: SamplingParams | None = None,
               enable_thinking: bool | None = None, drop_old_turns: bool = True) -> RequestStream:
        """Start one request and return its stream of text deltas. Raises PromptError for a prompt it cannot run."""
        sampling = self._resolve(params or SamplingParams())
        prepared = self.prepare(prompt=prompt, messages=messages, system_prompt=system_prompt,
                                enable_thinking=enable_thinking, max_new_tokens=sampling.max_new_tokens,
                                drop_old_turns=drop_old_turns)
        handle = self._submit(prepared, sampling, streaming=True)
        return RequestStream(handle, self.cancel, self.health)

    def generate(self, **kwargs) -> GenerationResult:
        """Like `stream` (same arguments), returning only the final result."""
        return self.stream(**kwargs).wait()

    def cancel(self, request_id: str) -> None:
        """Cancel a request: its stream ends at once with `cancelled` and its KV-cache blocks are freed."""
        with self._handles_lock:
            entry = self._handles.get(request_id)
        if entry is None:
            return
        manager = self._manager
        if manager is not None:
            manager.cancel_request(request_id)
        entry[1].cancel()

    def generate_many(self, requests: Iterable[BatchRequest],
                      cancel_event: threading.Event | None = None) -> Iterator[tuple[object, GenerationResult]]:
        """Run many requests, yielding `(key, result)` as each finishes (completion order, not input order).

        Rows enter the scheduler through a bounded number of engine-wide slots, so a chat request submitted
        meanwhile waits behind at most that many rows. A row whose prompt cannot run (empty, too long, malformed
        messages) yields an `error` result at once; the others go on. Closing the generator, or setting
        `cancel_event`, cancels the rows in flight; cancelled rows are not yielded.
        """
        self._require_started()
        finished: queue.Queue[RequestHandle] = queue.Queue()
        in_flight: dict[str, object] = {}
        slots = self._batch_slots
        pending = iter(requests)
        total = len(requests) if hasattr(requests, "__len__") else None
        submitted = 0
        exhausted = False
        self._add_waiting(total or 0)

        def on_end(handle: RequestHandle) -> None:
            slots.release()
            finished.put(handle)

        try:
            while True:
                stopping = cancel_event is not None and cancel_event.is_set()
                while not exhausted and not stopping and slots.acquire(timeout=0 if in_flight else POLL_INTERVAL_S):
                    try:
                        item = next(pending)
                    except StopIteration:
                        slots.release()
                        exhausted = True
                        break
                    submitted += 1
                    if total is not None:
                        self._add_waiting(-1)
                    try:
                        handle = self._start_row(item, on_end)
                    except PromptError as error:
                        slots.release()
                        yield item.key, GenerationResult(text="", finish_reason="error", error=str(error))
                        continue
                    in_flight[handle.request_id] = item.key
                if stopping or (exhausted and not in_flight):
                    return  # rows still in flight are cancelled below and never yielded
                if not in_flight:
                    continue  # every slot is held by another job: wait for one
                try:
                    handle = finished.get(timeout=POLL_INTERVAL_S)
                except queue.Empty:
                    problem = self.health()
                    if problem is not None:
                        for request_id in list(in_flight):
                            self.cancel(request_id)
                    continue
                yield in_flight.pop(handle.request_id), handle.result
        finally:
            for request_id in list(in_flight):
                self.cancel(request_id)
            if total is not None:
                self._add_waiting(-(total - submitted))

    def _start_row(self, item: BatchRequest, on_end) -> RequestHandle:
        sampling = self._resolve(item.params)
        prepared = self.prepare(prompt=item.prompt, messages=item.messages, system_prompt=item.system_prompt,
                                enable_thinking=item.enable_thinking, max_new_tokens=sampling.max_new_tokens)
        return self._submit(prepared, sampling, streaming=False, on_end=on_end, interactive=False)

    def _add_waiting(self, count: int) -> None:
        with self._rows_lock:
            self._rows_waiting += count

    # ---------------------------------------------------------------------------------------------------- facts --

    def _require_started(self) -> None:
        if self.loaded is None:
            raise RuntimeError("The engine is not started: call engine.start() first")

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def is_random_model(self) -> bool:
        return bool(self.loaded and self.loaded.is_random)

    @property
    def supports_thinking(self) -> bool:
        return bool(self.loaded) and template_takes_thinking(self.loaded.tokenizer)

    def count_tokens(self, text: str) -> int:
        self._require_started()
        return len(self.loaded.tokenizer.encode(text, add_special_tokens=False))

    @property
    def model_name(self) -> str:
        """The model as people know it: the Hub id, or a local folder's name (not the machine's full path)."""
        model_id = self.config.model_id
        if os.path.isdir(model_id):
            return f"{os.path.basename(os.path.normpath(model_id))} (local folder)"
        return model_id

    def stats(self) -> EngineStats:
        manager = self._manager
        processor = getattr(manager, "batch_processor", None) if manager is not None else None
        active = waiting = 0
        cache_used = None
        if processor is not None:
            scheduler = processor.scheduler
            active, waiting = len(scheduler.active_requests), len(scheduler.waiting_requests)
            cache_used = 1.0 - float(processor.cache.compute_free_capacity(relative=True))
        backend = self.backend
        with self._rows_lock:
            rows_waiting = self._rows_waiting
        return EngineStats(
            model=self.model_name,
            device=backend.device if backend else "?",
            dtype=backend.dtype if backend else "?",
            attention=self.attention_in_use or (backend.attn_implementation if backend else "?"),
            attention_reason=backend.reasons.get("attention", "") if backend else "",
            is_random_model=self.is_random_model,
            running=manager is not None and manager.is_running(),
            active_requests=active,
            queued_requests=waiting + max(rows_waiting, 0),
            tokens_per_second=self._meter.rate(),
            total_tokens=self._meter.total_tokens,
            kv_cache_used=cache_used,
            kv_cache_gib=self.kv_cache_bytes / GIB,
            max_batch_tokens=backend.max_batch_tokens if backend else 0,
            restarts=self._restarts,
        )


_shared_lock = threading.Lock()
_shared: dict[str, Engine] = {}


def get_engine(config: EngineConfig | None = None) -> Engine:
    """The process-wide engine, started on first use. Later calls must pass no config or the same one."""
    with _shared_lock:
        engine = _shared.get("engine")
        if engine is None:
            if config is None:
                raise RuntimeError("get_engine() needs an EngineConfig the first time it is called")
            engine = Engine(config).start()
            _shared["engine"] = engine
        elif config is not None and config != engine.config:
            raise RuntimeError(f"The process already runs an engine for {engine.config.model_id}; "
                               "one process serves one model")
        return engine

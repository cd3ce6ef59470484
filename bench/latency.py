"""Chat latency on the shared engine: idle, and while a large dataset job runs on the same engine.

    python -m bench.latency [--model-id M] [--device D] [--chats N] [--job-rows R] [--json FILE]

Measures time to first token (TTFT: from the call to `Engine.stream` until the engine receives the chat's first
generated token) and inter-token latency (ITL, between streamed text deltas) for chat requests sent one after
another with a random pause between them (`--think-ms`, like a person reading and typing; it also keeps each
chat from arriving exactly when a step starts, which back-to-back requests always do), first on an idle engine,
then while a dataset job of `--job-rows` rows keeps the engine busy. It also reports the time to the first
*visible* text, which comes one step later when the first token is held back (an incomplete UTF-8 character,
frequent with random weights, or the start of a possible stop string).
With `--compare-unbounded` it repeats the loaded run on a second engine that hands every dataset row to the
scheduler at once (no admission control), which is what a chat request would otherwise queue behind. Prints
p50/p95 and the loaded/idle ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

from bench.common import machine_description, make_workload, start_engine, write_json
from engine.config import SamplingParams, add_engine_arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", help="Random model shape when --model-id is not given")
    parser.add_argument("--chats", type=int, default=16, help="Chat requests per scenario")
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--think-ms", type=float, nargs=2, default=(50.0, 250.0), metavar=("MIN", "MAX"),
                        help="Random pause before each chat request, drawn uniformly (seeded)")
    parser.add_argument("--job-rows", type=int, default=400)
    parser.add_argument("--job-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--compare-unbounded", action="store_true",
                        help="Also run the loaded scenario without admission control (a second engine)")
    parser.add_argument("--json", help="Write the figures to this file")
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


@dataclass
class ChatTimings:
    """Milliseconds, one entry per chat (ttft, first_text) or per gap between streamed deltas (itl)."""

    ttft: list[float] = field(default_factory=list)
    first_text: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def chat_latencies(engine, prompts: list[str], max_new_tokens: int, think_ms: tuple[float, float],
                   seed: int = 11) -> ChatTimings:
    """Send chats one after another, each after a random pause; return their timings."""
    timings = ChatTimings()
    pauses = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        time.sleep(pauses.uniform(*think_ms) / 1000)
        start = time.perf_counter()
        last = None
        stream = engine.stream(prompt=prompt, params=params)
        for _ in stream:
            now = time.perf_counter()
            if last is None:
                timings.first_text.append((now - start) * 1000)
            else:
                timings.itl.append((now - last) * 1000)
            last = now
        if stream.first_token_at is not None:
            timings.ttft.append((stream.first_token_at - start) * 1000)
    return timings


def run_loaded(engine, chat_prompts, args) -> dict:
    from engine.engine import BatchRequest

    job = make_workload(args.job_rows, (20, 120), tuple(args.job_tokens), seed=3)
    rows = [BatchRequest(key=i, prompt=p, params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(job.prompts, job.answer_lengths, strict=True))]
    cancel = threading.Event()
    finished = []
    worker = threading.Thread(target=lambda: finished.extend(engine.generate_many(rows, cancel_event=cancel)),
                              name="bench-dataset-job")
    worker.start()
    time.sleep(2.0)  # let the job fill the batch
    busy = engine.stats()
    start = time.perf_counter()
    timings = chat_latencies(engine, chat_prompts, args.chat_tokens, tuple(args.think_ms))
    seconds = time.perf_counter() - start
    job_tokens = engine.stats().total_tokens - busy.total_tokens - len(chat_prompts) * args.chat_tokens
    rows_done_during_chats = len(finished)
    cancel.set()
    worker.join(timeout=120)
    return {"timings": timings, "active_at_start": busy.active_requests, "job_tok_s": job_tokens / seconds,
            "queued_at_start": busy.queued_requests, "job_rows_finished": rows_done_during_chats}


def summarize(prefix: str, timings: ChatTimings) -> dict:
    figures = {}
    for kind, values in (("ttft", timings.ttft), ("first_text", timings.first_text), ("itl", timings.itl)):
        figures[f"{kind}_{prefix}_p50_ms"] = statistics.median(values) if values else float("nan")
        figures[f"{kind}_{prefix}_p95_ms"] = percentile(values, 0.95)
    return figures


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine = start_engine(args)
    chat_prompts = make_workload(args.chats, (30, 60), (1, 1), seed=7).prompts
    engine.generate(prompt="warm up", params=SamplingParams(temperature=0.0, max_new_tokens=4))

    idle = chat_latencies(engine, chat_prompts, args.chat_tokens, tuple(args.think_ms))
    loaded = run_loaded(engine, chat_prompts, args)
    figures = {**summarize("idle", idle), **summarize("loaded", loaded["timings"]),
               "loaded_active_requests": loaded["active_at_start"], "loaded_queued_rows": loaded["queued_at_start"],
               "job_tok_s_during_chats": loaded["job_tok_s"],
               "dataset_tokens_while_chatting": engine.backend.dataset_tokens_while_chatting,
               "max_batch_inflight": engine.backend.max_batch_inflight, "chats": args.chats,
               "think_ms": list(args.think_ms),
               "machine": machine_description(engine)}
    figures["ttft_loaded_vs_idle"] = figures["ttft_loaded_p50_ms"] / figures["ttft_idle_p50_ms"]
    figures["first_text_loaded_vs_idle"] = figures["first_text_loaded_p50_ms"] / figures["first_text_idle_p50_ms"]
    engine.shutdown()

    if args.compare_unbounded:
        unbounded = start_engine(args, max_batch_inflight=10**6)
        free_for_all = run_loaded(unbounded, chat_prompts, args)
        figures.update(summarize("unbounded", free_for_all["timings"]))
        figures["ttft_unbounded_vs_idle"] = figures["ttft_unbounded_p50_ms"] / figures["ttft_idle_p50_ms"]
        unbounded.shutdown()

    print(f"\nChats: {args.chats} x {args.chat_tokens} tokens; dataset job: {args.job_rows} rows of "
          f"{args.job_tokens[0]}-{args.job_tokens[1]} tokens; admission limit {figures['max_batch_inflight']} rows")
    print(f"Machine: {figures['machine']}")
    print(f"{'scenario':<28}{'TTFT p50':>10}{'TTFT p95':>10}{'text p50':>10}{'text p95':>10}"
          f"{'ITL p50':>10}{'ITL p95':>10}  (ms; text = first visible text)")
    for name, label in (("idle", "idle engine"), ("loaded", "during dataset job"),
                        ("unbounded", "job, no admission control")):
        if f"ttft_{name}_p50_ms" in figures:
            print(f"{label:<28}" + "".join(f"{figures[f'{kind}_{name}_{q}_ms']:>10.1f}"
                                           for kind in ("ttft", "first_text", "itl") for q in ("p50", "p95")))
    print(f"Dataset job during the chats: {figures['job_tok_s_during_chats']:.1f} tok/s (dataset tokens per step "
          f"while a chat streams: {figures['dataset_tokens_while_chatting'] or 'no cap'})")
    print(f"First visible text loaded / idle = {figures['first_text_loaded_vs_idle']:.2f}")
    print(f"TTFT loaded / idle = {figures['ttft_loaded_vs_idle']:.2f}" +
          (f"; without admission control = {figures['ttft_unbounded_vs_idle']:.2f}"
           if "ttft_unbounded_vs_idle" in figures else ""))
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()

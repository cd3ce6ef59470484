"""Chat latency on the shared engine: idle, and while a large dataset job runs on the same engine.

    python -m bench.latency [--model-id M] [--device D] [--chats N] [--job-rows R] [--json FILE]

Measures time to first token (TTFT) and inter-token latency (ITL, between streamed deltas) for chat requests sent
one after another, first on an idle engine, then while a dataset job of `--job-rows` rows keeps the engine busy.
With `--compare-unbounded` it repeats the loaded run on a second engine that hands every dataset row to the
scheduler at once (no admission control), which is what a chat request would otherwise queue behind. Prints
p50/p95 and the loaded/idle ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from bench.common import machine_description, make_workload, start_engine, write_json
from engine.config import SamplingParams, add_engine_arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", help="Random model shape when --model-id is not given")
    parser.add_argument("--chats", type=int, default=12, help="Chat requests per scenario")
    parser.add_argument("--chat-tokens", type=int, default=32)
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


def chat_latencies(engine, prompts: list[str], max_new_tokens: int) -> tuple[list[float], list[float]]:
    """Send chats one after another; return TTFTs and inter-delta gaps, in milliseconds."""
    ttfts, gaps = [], []
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        start = time.perf_counter()
        last = None
        for _ in engine.stream(prompt=prompt, params=params):
            now = time.perf_counter()
            if last is None:
                ttfts.append((now - start) * 1000)
            else:
                gaps.append((now - last) * 1000)
            last = now
    return ttfts, gaps


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
    ttfts, gaps = chat_latencies(engine, chat_prompts, args.chat_tokens)
    rows_done_during_chats = len(finished)
    cancel.set()
    worker.join(timeout=120)
    return {"ttft": ttfts, "itl": gaps, "active_at_start": busy.active_requests,
            "queued_at_start": busy.queued_requests, "job_rows_finished": rows_done_during_chats}


def summarize(prefix: str, ttfts: list[float], gaps: list[float]) -> dict:
    return {f"ttft_{prefix}_p50_ms": statistics.median(ttfts), f"ttft_{prefix}_p95_ms": percentile(ttfts, 0.95),
            f"itl_{prefix}_p50_ms": statistics.median(gaps) if gaps else float("nan"),
            f"itl_{prefix}_p95_ms": percentile(gaps, 0.95)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine = start_engine(args)
    chat_prompts = make_workload(args.chats, (30, 60), (1, 1), seed=7).prompts
    engine.generate(prompt="warm up", params=SamplingParams(temperature=0.0, max_new_tokens=4))

    idle_ttft, idle_itl = chat_latencies(engine, chat_prompts, args.chat_tokens)
    loaded = run_loaded(engine, chat_prompts, args)
    figures = {**summarize("idle", idle_ttft, idle_itl), **summarize("loaded", loaded["ttft"], loaded["itl"]),
               "loaded_active_requests": loaded["active_at_start"], "loaded_queued_rows": loaded["queued_at_start"],
               "max_batch_inflight": engine.backend.max_batch_inflight, "chats": args.chats,
               "machine": machine_description(engine)}
    figures["ttft_loaded_vs_idle"] = figures["ttft_loaded_p50_ms"] / figures["ttft_idle_p50_ms"]
    engine.shutdown()

    if args.compare_unbounded:
        unbounded = start_engine(args, max_batch_inflight=10**6)
        free_for_all = run_loaded(unbounded, chat_prompts, args)
        figures.update(summarize("unbounded", free_for_all["ttft"], free_for_all["itl"]))
        figures["ttft_unbounded_vs_idle"] = figures["ttft_unbounded_p50_ms"] / figures["ttft_idle_p50_ms"]
        unbounded.shutdown()

    print(f"\nChats: {args.chats} x {args.chat_tokens} tokens; dataset job: {args.job_rows} rows of "
          f"{args.job_tokens[0]}-{args.job_tokens[1]} tokens; admission limit {figures['max_batch_inflight']} rows")
    print(f"Machine: {figures['machine']}")
    print(f"{'scenario':<28}{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>10}{'ITL p95':>10}  (ms)")
    for name, label in (("idle", "idle engine"), ("loaded", "during dataset job"),
                        ("unbounded", "job, no admission control")):
        if f"ttft_{name}_p50_ms" in figures:
            print(f"{label:<28}" + "".join(f"{figures[f'{kind}_{name}_{q}_ms']:>10.1f}"
                                           for kind in ("ttft", "itl") for q in ("p50", "p95")))
    print(f"TTFT loaded / idle = {figures['ttft_loaded_vs_idle']:.2f}" +
          (f"; without admission control = {figures['ttft_unbounded_vs_idle']:.2f}"
           if "ttft_unbounded_vs_idle" in figures else ""))
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()

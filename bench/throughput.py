"""Throughput, side by side in one process: the engine's batch path, raw continuous batching, padded generate.

    python -m bench.throughput [--model-id M] [--device D] [--requests N] [--json FILE]

The same workload (prompts of mixed lengths, per-request answer lengths, EOS off so every run produces exactly the
same useful tokens) runs through
  (a) the engine's dataset path (`Engine.generate_many`, the call `engine.batch_job` makes),
  (b) raw transformers CB (its manager, same cache size, batch tokens, page size and attention),
  (c) padded `model.generate` in fixed batches (each batch runs to its longest answer; only useful tokens count),
  (d) raw transformers CB with its stock sdpa attention, when the engine runs our per-request attention.
It prints useful tokens/s for each and the ratios; nothing is asserted. Defaults fit a 2-core CPU in about a
minute (a random-weight Qwen2 of hidden 256, 4 layers).
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import (
    cb_config_like,
    machine_description,
    make_workload,
    run_padded_generate,
    run_raw_cb,
    start_engine,
    write_json,
)
from engine.config import SamplingParams, add_engine_arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", help="Random model shape when --model-id is not given")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(8, 120), metavar=("MIN", "MAX"))
    parser.add_argument("--answer-tokens", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--padded-batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4,
                        help="Run the engine and raw CB in this many adjacent pairs; the ratio is the median of the "
                             "pairs' ratios (this machine's speed drifts by tens of percent between runs)")
    parser.add_argument("--skip-padded", action="store_true")
    parser.add_argument("--skip-stock", action="store_true",
                        help="Skip (d): raw CB with transformers' stock sdpa attention")
    parser.add_argument("--json", help="Write the figures to this file")
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import time

    from engine.engine import BatchRequest

    engine = start_engine(args)
    workload = make_workload(args.requests, tuple(args.prompt_words), tuple(args.answer_tokens))
    prompt_ids = [engine.prepare(prompt=p).token_ids for p in workload.prompts]
    model = engine.loaded.model

    def engine_run() -> tuple[float, int]:
        rows = [BatchRequest(key=i, prompt=p, params=SamplingParams(temperature=0.0, max_new_tokens=n,
                                                                    ignore_eos=True))
                for i, (p, n) in enumerate(zip(workload.prompts, workload.answer_lengths, strict=False))]
        start = time.perf_counter()
        results = dict(engine.generate_many(rows))
        return time.perf_counter() - start, sum(r.completion_tokens for r in results.values())

    # Warm the engine once (first-step allocations), then alternate engine and raw CB runs; the engine stays up
    # but idle while raw CB runs its own manager (and KV cache) on the same model.
    engine.generate(prompt=make_workload(1, (4, 16), (4, 8), seed=1).prompts[0],
                    params=SamplingParams(temperature=0.0, max_new_tokens=4))
    engine_runs, raw_runs = [], []
    for _ in range(max(1, args.repeats)):
        engine_runs.append(engine_run())
        raw_runs.append(run_raw_cb(model, prompt_ids, workload.answer_lengths, cb_config_like(engine)))
    engine_seconds, engine_tokens = min(engine_runs)
    raw = min(raw_runs, key=lambda run: run["seconds"])
    engine.shutdown()
    stock = None
    if not args.skip_stock and engine.attention_in_use != "sdpa":
        model.set_attn_implementation("sdpa")
        stock = run_raw_cb(model, prompt_ids, workload.answer_lengths, cb_config_like(engine, attention="sdpa"))
        stock["identical_outputs"] = sum(a == b for a, b in zip(stock["outputs"], raw["outputs"], strict=True))
    padded = None
    if not args.skip_padded:
        pad_id = engine.loaded.tokenizer.pad_token_id or 0
        padded = run_padded_generate(model, prompt_ids, workload.answer_lengths, args.padded_batch_size, pad_id)

    useful = workload.useful_tokens
    figures = {
        "engine_tok_s": engine_tokens / engine_seconds,
        "raw_cb_tok_s": raw["tokens"] / raw["seconds"],
        "padded_tok_s": useful / padded["seconds"] if padded else None,
        "raw_cb_stock_sdpa_tok_s": stock["tokens"] / stock["seconds"] if stock else None,
        "useful_tokens": useful,
        "engine_tokens": engine_tokens,
        "raw_cb_tokens": raw["tokens"],
        "padded_tokens_computed": padded["tokens_computed"] if padded else None,
        "requests": args.requests,
        "repeats": args.repeats,
        "engine_runs_tok_s": [tokens / seconds for seconds, tokens in engine_runs],
        "raw_cb_runs_tok_s": [run["tokens"] / run["seconds"] for run in raw_runs],
        "prompt_tokens_mean": sum(map(len, prompt_ids)) / len(prompt_ids),
        "model": args.model_id if not args.model_id.endswith(f"bench-{args.shape}") else f"random {args.shape}",
        "machine": machine_description(engine),
    }
    pair_ratios = sorted((tokens / seconds) / (run["tokens"] / run["seconds"])
                         for (seconds, tokens), run in zip(engine_runs, raw_runs, strict=True))
    figures["engine_vs_raw_cb_pairs"] = pair_ratios
    figures["engine_vs_raw_cb"] = statistics.median(pair_ratios)
    if stock:
        figures["engine_vs_raw_cb_stock_sdpa"] = figures["engine_tok_s"] / figures["raw_cb_stock_sdpa_tok_s"]
        figures["stock_vs_ours_identical_greedy"] = f"{stock['identical_outputs']}/{len(prompt_ids)}"
    if padded:
        figures["engine_vs_padded"] = figures["engine_tok_s"] / figures["padded_tok_s"]
        figures["raw_cb_vs_padded"] = figures["raw_cb_tok_s"] / figures["padded_tok_s"]
    print(f"\nWorkload: {args.requests} requests, prompts {figures['prompt_tokens_mean']:.0f} tokens on average, "
          f"answers {args.answer_tokens[0]}-{args.answer_tokens[1]} tokens ({useful} useful tokens, EOS off)")
    print(f"Machine: {figures['machine']}")
    print(f"{'path':<34}{'useful tok/s':>14}   (engine and raw CB: best of {args.repeats} adjacent pairs)")
    print(f"{'engine (generate_many)':<34}{figures['engine_tok_s']:>14.1f}")
    print(f"{'raw CB, same attention':<34}{figures['raw_cb_tok_s']:>14.1f}")
    if stock:
        print(f"{'raw CB, stock sdpa':<34}{figures['raw_cb_stock_sdpa_tok_s']:>14.1f}   (greedy identical for "
              f"{figures['stock_vs_ours_identical_greedy']} requests)")
    if padded:
        print(f"{f'padded generate (batch {args.padded_batch_size})':<34}{figures['padded_tok_s']:>14.1f}")
    if stock:
        print(f"engine / raw CB with stock sdpa = {figures['engine_vs_raw_cb_stock_sdpa']:.2f}")
    print(f"engine / raw CB = {figures['engine_vs_raw_cb']:.2f} (median of pairs: "
          f"{', '.join(f'{r:.2f}' for r in pair_ratios)})" +
          (f"; engine / padded = {figures['engine_vs_padded']:.2f}; raw CB / padded = "
           f"{figures['raw_cb_vs_padded']:.2f}" if padded else ""))
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()

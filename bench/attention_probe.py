"""Raw continuous batching throughput: transformers' stock paged `sdpa` vs CB Studio's per-request attention.

    python -m bench.attention_probe                 # default workload, under a minute on 2 CPU cores
    python -m bench.attention_probe --profile       # then profile the loop thread with our attention (cProfile)

A Qwen2-shaped model with random weights (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 1024) serves the same
mixed workload (prompt and answer lengths drawn at random, EOS disabled so every request runs to its
`max_new_tokens`) through a raw CB manager, once with `attn_implementation="sdpa"` and once with
`engine.attention`'s name, on the same weights. It prints generated tokens per second for both, the ratio, and
whether the greedy outputs are identical token for token. Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import sys
import time

from bench.common import run_raw_cb


def build_model(seed: int = 0, vocab_size: int = 1024):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.5, tie_word_embeddings=True,
        eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def machine_probe_ms() -> float:
    """Milliseconds for a fixed matmul loop: a yardstick for how fast this (possibly shared) machine runs now."""
    import torch

    matrix = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(100):
        matrix @ matrix
    return (time.perf_counter() - start) * 1e3


def make_workload(num_requests: int, prompt_range: tuple[int, int], answer_range: tuple[int, int], vocab: int,
                  seed: int = 1):
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_requests,), generator=generator).tolist()
    answers = torch.randint(answer_range[0], answer_range[1] + 1, (num_requests,), generator=generator).tolist()
    prompts = [torch.randint(1, vocab, (length,), generator=generator).tolist() for length in lengths]
    return prompts, answers


def run_cb(model, prompts, answers, max_batch_tokens: int, page_size: int = 32, profiler: cProfile.Profile | None = None):
    """Serve the workload through one raw CB manager, cache sized to the workload; (seconds, outputs, CB config)."""
    from transformers import ContinuousBatchingConfig

    total_tokens = sum(len(p) + a for p, a in zip(prompts, answers, strict=True))
    cb_config = ContinuousBatchingConfig(num_blocks=total_tokens // page_size + len(prompts) + 16,
                                         max_batch_tokens=max_batch_tokens, page_size=page_size,
                                         auto_switch_to_flash=False, allow_block_sharing=False)
    run = run_raw_cb(model, prompts, answers, cb_config, timeout_s=600, profiler=profiler)
    return run["seconds"], dict(enumerate(run["outputs"])), run["resolved_config"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--answer-min", type=int, default=8)
    parser.add_argument("--answer-max", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="alternate the implementations this many times")
    parser.add_argument("--skip-stock", action="store_true", help="only run our attention")
    parser.add_argument("--profile", action="store_true", help="profile the loop thread with our attention")
    args = parser.parse_args(argv)

    import torch

    from engine.attention import register_attention

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = register_attention()
    model = build_model()
    prompts, answers = make_workload(args.requests, (args.prompt_min, args.prompt_max),
                                     (args.answer_min, args.answer_max), model.config.vocab_size)
    generated = sum(answers)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} requests, prompts "
          f"{args.prompt_min}-{args.prompt_max} tokens ({sum(map(len, prompts))} in all), answers "
          f"{args.answer_min}-{args.answer_max} ({generated} in all), max_batch_tokens {args.max_batch_tokens}")

    # A short warm-up so neither measured run pays first-call costs
    model.set_attn_implementation(name)
    run_cb(model, prompts[:4], [4] * 4, args.max_batch_tokens)

    # This machine's speed drifts (shared host): each run prints a fixed matmul probe next to its time, and with
    # --repeats the implementations alternate and the best run of each is compared.
    implementations = ([] if args.skip_stock else ["sdpa"]) + [name]
    times: dict[str, list[float]] = {implementation: [] for implementation in implementations}
    outputs_by_implementation: dict[str, dict[int, list[int]]] = {}
    for _ in range(args.repeats):
        for implementation in implementations:
            model.set_attn_implementation(implementation)
            probe = machine_probe_ms()
            seconds, outputs, resolved = run_cb(model, prompts, answers, args.max_batch_tokens)
            times[implementation].append(seconds)
            outputs_by_implementation[implementation] = outputs
            print(f"{implementation:>20}: {seconds:6.2f} s, {generated / seconds:7.1f} generated tok/s  (probe "
                  f"{probe:.0f} ms; CB: cuda graphs {resolved.use_cuda_graph}, decode fast path blocks "
                  f"{resolved.max_blocks_per_request})", flush=True)
    if "sdpa" in times:
        best_stock, best_ours = min(times["sdpa"]), min(times[name])
        stock_outputs, our_outputs = outputs_by_implementation["sdpa"], outputs_by_implementation[name]
        same = sum(stock_outputs[i] == our_outputs[i] for i in range(len(prompts)))
        print(f"best runs: sdpa {generated / best_stock:.1f} tok/s, {name} {generated / best_ours:.1f} tok/s: "
              f"speed-up {best_stock / best_ours:.2f}x; greedy outputs identical for {same}/{len(prompts)} requests")

    if args.profile:
        model.set_attn_implementation(name)
        profiler = cProfile.Profile()
        seconds, _, _ = run_cb(model, prompts, answers, args.max_batch_tokens, profiler=profiler)
        print(f"\nprofiled run ({name}): {seconds:.2f} s (profiling overhead included)")
        for order in ("tottime", "cumulative"):
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats(order).print_stats(25)
            print(stream.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

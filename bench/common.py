"""What the benchmarks share: random-weight models of real shapes, a dataset-like workload, and the baselines.

- `build_shape_model(shape)`: a Qwen2 model of a named shape ("small" for this 2-core CPU, "qwen2.5-0.5b" for a
  GPU) with random weights and the tiny model's real tokenizer (padded with added tokens up to the shape's
  vocabulary), saved with `save_pretrained` so the engine loads it like any Hub model;
- `make_workload(...)`: prompts of mixed lengths and per-request answer lengths, seeded;
- `run_raw_cb(...)`: transformers' continuous batching driven directly (the manager, per-request max_new_tokens,
  EOS off), with the same cache settings the engine uses;
- `run_padded_generate(...)`: `model.generate` in fixed, left-padded batches; each batch runs to its longest answer
  and only the requested tokens count as useful.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import platform
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHAPES = {
    # hidden 256 / 4 layers: the CPU profile in FACTS.md; answers in about a minute on 2 cores. Saved in fp32.
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=None, max_position_embeddings=4096),
    # Saved in bf16, like the real checkpoint (so the engine picks what it would for Qwen2.5-0.5B-Instruct).
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
}

_WORDS = ["the", "model", "reads", "a", "prompt", "and", "writes", "an", "answer", "token", "by", "token", "while", "other", "requests", "join", "and", "leave", "the", "batch", "data", "rows", "questions", "summaries", "translation", "code", "review", "recipe", "history", "science"]


def build_shape_model(shape: str, folder: Path | None = None) -> Path:
    """Build (once) a random-weight Qwen2 model of the named shape with a real tokenizer; returns its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    from engine.tiny_model import build_tiny_model, default_cache_dir

    sizes = dict(SHAPES[shape])
    dtype = torch.bfloat16 if shape == "qwen2.5-0.5b" else torch.float32
    path = folder or default_cache_dir() / f"bench-{shape}"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    vocab = sizes.pop("vocab_size") or len(tokenizer)
    if vocab > len(tokenizer):  # real vocabulary size: pad with added tokens so every id decodes
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tokenizer))])
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, initializer_range=0.5, **sizes)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                               do_sample=False, max_new_tokens=128)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    answer_lengths: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.answer_lengths)


def make_workload(requests: int, prompt_words: tuple[int, int], answer_tokens: tuple[int, int],
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*prompt_words))) + f" (#{i})"
               for i in range(requests)]
    return Workload(prompts=prompts, answer_lengths=[rng.randint(*answer_tokens) for _ in range(requests)])


def cb_config_like(engine, attention: str | None = None):
    """A ContinuousBatchingConfig with the engine's own cache geometry, for a like-for-like raw CB run."""
    from transformers import ContinuousBatchingConfig

    from engine.backend import PER_REQUEST_ATTENTION

    attention = attention or engine.attention_in_use
    graphs = False if attention == PER_REQUEST_ATTENTION else engine.config.use_cuda_graph
    return ContinuousBatchingConfig(num_blocks=engine._cache_plan.num_blocks,
                                    max_batch_tokens=engine.backend.max_batch_tokens,
                                    page_size=engine.backend.page_size, use_cuda_graph=graphs,
                                    auto_switch_to_flash=engine.config.attn_implementation == "auto")


def greedy_generation_config(model, max_new_tokens: int):
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.temperature = config.top_p = config.top_k = None
    config.max_new_tokens = max_new_tokens
    config.eos_token_id = None
    return config


def run_raw_cb(model, prompt_ids: list[list[int]], answer_lengths: list[int], cb_config,
               timeout_s: float = 1800, profiler=None, paged_reads: bool = True) -> dict:
    """Drive transformers' manager directly: every request at once, its own max_new_tokens, EOS off.

    Returns seconds, tokens, outputs (by request index) and CB's resolved config. A `cProfile.Profile` given as
    `profiler` profiles the generation loop, which runs in its own thread. With the engine's per-request attention,
    the cache gets engine.paged_reads as in the engine (set `paged_reads=False` to measure without)."""
    from engine.backend import PER_REQUEST_ATTENTION
    from engine.paged_reads import install_paged_reads

    manager = model.init_continuous_batching(generation_config=greedy_generation_config(model, max(answer_lengths)),
                                             continuous_batching_config=copy.deepcopy(cb_config))
    manager.warmup()
    if paged_reads and model.config._attn_implementation == PER_REQUEST_ATTENTION:
        install_paged_reads(manager.batch_processor.cache)  # as the engine does: part of our attention path
    if profiler is not None:
        loop = manager._run_generation_loop

        def profiled_loop(*args, **kwargs):
            profiler.enable()
            try:
                return loop(*args, **kwargs)
            finally:
                profiler.disable()

        manager._run_generation_loop = profiled_loop
    manager.start()
    start = time.perf_counter()
    try:
        for index, (ids, length) in enumerate(zip(prompt_ids, answer_lengths, strict=True)):
            manager.add_request(ids, request_id=f"raw-{index}", max_new_tokens=length, eos_token_id=-1)
        outputs: dict[str, list[int]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outputs) < len(prompt_ids) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    if len(outputs) < len(prompt_ids):
        raise RuntimeError(f"only {len(outputs)} of {len(prompt_ids)} requests finished in {timeout_s:.0f}s")
    return {"seconds": seconds, "tokens": sum(len(t) for t in outputs.values()),
            "outputs": [outputs[f"raw-{i}"] for i in range(len(prompt_ids))],
            "resolved_config": manager.continuous_batching_config}


def run_padded_generate(model, prompt_ids: list[list[int]], answer_lengths: list[int], batch_size: int,
                        pad_id: int) -> dict:
    """`model.generate` in fixed batches, left-padded; every batch runs to its longest answer."""
    import torch

    config = greedy_generation_config(model, 1)
    start = time.perf_counter()
    generated = 0
    for begin in range(0, len(prompt_ids), batch_size):
        batch = prompt_ids[begin:begin + batch_size]
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):
            input_ids[row, longest - len(ids):] = torch.tensor(ids)
            mask[row, longest - len(ids):] = 1
        steps = max(answer_lengths[begin:begin + batch_size])
        with torch.no_grad():
            output = model.generate(input_ids.to(model.device), attention_mask=mask.to(model.device),
                                    generation_config=config, max_new_tokens=steps, min_new_tokens=steps,
                                    pad_token_id=pad_id)
        generated += (output.shape[1] - longest) * len(batch)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_computed": generated}


def machine_description(engine) -> dict:
    import torch
    import transformers

    device = engine.backend.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or platform.machine()
    model = engine.loaded.model
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = {"model_gib": model_bytes / 1024**3, "kv_cache_gib": round(engine.kv_cache_bytes / 1024**3, 3)}
    if device.startswith("cuda"):
        memory["cuda_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 1024**3, 3)
    else:  # ru_maxrss is in KiB on Linux: the whole process's peak, model, cache and the baselines' buffers included
        memory["process_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 3)
    return {"device": device, "device_name": name, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "dtype": engine.backend.dtype,
            "attention": engine.attention_in_use, "max_batch_tokens": engine.backend.max_batch_tokens,
            "max_batch_inflight": engine.backend.max_batch_inflight, "page_size": engine.backend.page_size,
            **memory, "date": time.strftime("%Y-%m-%d")}


def start_engine(args, **overrides):
    """Logging set up, the model chosen (a random model of `--shape` unless `--model-id`), the engine started."""
    from engine.config import engine_config_from_args
    from engine.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    if args.model_id is None:
        args.model_id = str(build_shape_model(args.shape))
    config = engine_config_from_args(args).with_overrides(**overrides)
    return Engine(config).start()


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        logger.info("Wrote %s", path)

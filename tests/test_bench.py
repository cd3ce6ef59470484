"""The benchmarks run end to end on the tiny model and write the figures the README quotes.

Speeds are never asserted (they are measurements, see bench/); what is asserted is that every path generated
exactly the useful tokens of the workload, that greedy outputs agree across attention paths, and that the JSON
carries the keys the benchmark issue promises.
"""

from __future__ import annotations

import json
import math


def test_throughput_runs_every_path_on_the_same_tokens(tiny_model_path, tmp_path):
    from bench import throughput

    out = tmp_path / "throughput.json"
    figures = throughput.main(["--model-id", tiny_model_path, "--device", "cpu", "--requests", "6",
                               "--prompt-words", "4", "20", "--answer-tokens", "2", "6", "--repeats", "1",
                               "--padded-batch-size", "3", "--json", str(out)])
    written = json.loads(out.read_text())
    for key in ("engine_tok_s", "raw_cb_tok_s", "padded_tok_s", "raw_cb_stock_sdpa_tok_s", "engine_vs_raw_cb"):
        assert written[key] > 0, key
    assert written["engine_tokens"] == written["raw_cb_tokens"] == written["useful_tokens"] == figures["useful_tokens"]
    # Padded generate runs each batch to its longest answer: at least the useful tokens are computed.
    assert written["padded_tokens_computed"] >= written["useful_tokens"]
    assert written["stock_vs_ours_identical_greedy"] == "6/6"
    assert written["machine"]["model_gib"] > 0 and written["machine"]["kv_cache_gib"] > 0


def test_latency_reports_idle_and_loaded_chat_timings(tiny_model_path, tmp_path):
    from bench import latency

    out = tmp_path / "latency.json"
    latency.main(["--model-id", tiny_model_path, "--device", "cpu", "--chats", "2", "--chat-tokens", "4",
                  "--job-rows", "12", "--job-tokens", "4", "8", "--think-ms", "0", "5", "--json", str(out)])
    written = json.loads(out.read_text())
    for key in ("ttft_idle_p50_ms", "ttft_loaded_p50_ms", "first_text_idle_p50_ms", "itl_idle_p50_ms",
                "ttft_loaded_vs_idle"):
        assert math.isfinite(written[key]) and written[key] > 0, key
    # The first token is seen before (or when) the first visible text is.
    assert written["ttft_idle_p50_ms"] <= written["first_text_idle_p50_ms"] + 1e-6

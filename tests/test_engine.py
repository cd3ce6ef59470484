"""The shared engine on real (tiny, random-weight) Qwen2 and Llama models: exactness, streaming, sampling, faults."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.engine import BatchRequest
from engine.loader import ModelLoadError
from engine.prompts import PromptError, PromptTooLongError
from tests.conftest import greedy_reference

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [("word " * n + f"question {n}?").strip() for n in range(0, 48, 3)]  # 16 prompts of different lengths


def _decode(engine, ids):
    return engine.loaded.tokenizer.decode(ids, skip_special_tokens=True)


def _check_greedy_equals_generate(engine, prompts, max_new_tokens_for):
    def run(index_prompt):
        index, prompt = index_prompt
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens_for(index))
        stream = engine.stream(prompt=prompt, params=params)
        deltas = [delta.text for delta in stream]
        return stream.result, "".join(deltas)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:  # all in flight at once: batched together
        outcomes = list(pool.map(run, enumerate(prompts)))
    for index, (prompt, (result, streamed)) in enumerate(zip(prompts, outcomes, strict=True)):
        prompt_ids = engine.prepare(prompt=prompt).token_ids
        reference = greedy_reference(engine, prompt_ids, max_new_tokens_for(index))
        assert result.finish_reason in ("stop", "length"), result
        assert result.completion_tokens == len(reference), (index, result)
        assert result.reasoning is None
        assert result.text == _decode(engine, reference), index
        assert streamed == result.text


def test_greedy_equals_generate_qwen2_concurrent(engine):
    _check_greedy_equals_generate(engine, PROMPTS, lambda i: 8 + 5 * i)


def test_greedy_equals_generate_llama_concurrent(llama_engine):
    _check_greedy_equals_generate(llama_engine, PROMPTS, lambda i: 40 - 2 * i)


def test_bf16_checkpoint_runs_in_bf16_on_a_cpu_with_native_bf16(tiny_model_path, start_engine, tmp_path):
    """The dtype a user gets by default for a bf16 checkpoint (like Qwen2.5) on such a CPU, greedy-exact as well."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.backend import probe_device_facts

    folder = tmp_path / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    bf16_engine = start_engine(str(folder))
    native = probe_device_facts().cpu_bf16
    assert bf16_engine.backend.dtype == ("bfloat16" if native else "float32"), bf16_engine.backend.reasons["dtype"]
    assert bf16_engine.loaded.model.dtype == getattr(torch, bf16_engine.backend.dtype)
    _check_greedy_equals_generate(bf16_engine, PROMPTS[:8], lambda i: 6 + 3 * i)


def test_generate_many_greedy_equals_generate(engine):
    rows = [BatchRequest(key=i, prompt=p, params=SamplingParams(temperature=0.0, max_new_tokens=12))
            for i, p in enumerate(PROMPTS)]
    results = dict(engine.generate_many(rows))
    assert sorted(results) == list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        reference = greedy_reference(engine, engine.prepare(prompt=prompt).token_ids, 12)
        assert results[i].text == _decode(engine, reference)
        assert results[i].completion_tokens == len(reference)


def test_stream_deltas_add_up_to_final_text(engine):
    for seed in range(6):
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=60, seed=seed)
        stream = engine.stream(prompt=f"Tell me about café 😀 number {seed}", params=params)
        deltas = [delta.text for delta in stream]
        assert "".join(deltas) == stream.result.text
        # The engine's text is exactly what decode(skip_special_tokens=True) gives: no special tokens leak out.
        assert "<|im_end|>" not in stream.result.text and "<|endoftext|>" not in stream.result.text


def test_cancel_mid_stream_frees_the_request(engine):
    stream = engine.stream(prompt="a long answer please", params=SamplingParams(temperature=0.0,
                                                                               max_new_tokens=900))
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    cancelled_at = time.monotonic()
    stream.cancel()
    rest = list(stream)
    assert time.monotonic() - cancelled_at < 2.0
    assert stream.result.finish_reason == "cancelled"
    assert stream.result.completion_tokens < 900
    assert rest == [] or all(d.text for d in rest)
    deadline = time.monotonic() + 5
    while engine.stats().active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().active_requests == 0


def test_per_request_sampling_side_by_side(engine):
    prompt = "Sampling check: pick words"
    prompt_ids = engine.prepare(prompt=prompt).token_ids
    greedy_text = _decode(engine, greedy_reference(engine, prompt_ids, 24))
    configs = {
        "greedy": SamplingParams(temperature=0.0, max_new_tokens=24),
        "hot": SamplingParams(temperature=5.0, top_k=0, top_p=1.0, max_new_tokens=24, seed=1),
        "hot_other_seed": SamplingParams(temperature=5.0, top_k=0, top_p=1.0, max_new_tokens=24, seed=2),
        "hot_top1": SamplingParams(temperature=5.0, top_k=1, top_p=1.0, max_new_tokens=24, seed=3),
    }
    with ThreadPoolExecutor(max_workers=len(configs)) as pool:
        futures = {name: pool.submit(engine.generate, prompt=prompt, params=p) for name, p in configs.items()}
        texts = {name: future.result().text for name, future in futures.items()}
    assert texts["greedy"] == greedy_text  # a greedy request beside sampled ones stays greedy
    assert texts["hot_top1"] == greedy_text  # top_k=1 is honoured per request, whatever the temperature
    assert texts["hot"] != greedy_text
    assert texts["hot"] != texts["hot_other_seed"]


def test_seed_reproducible_whatever_shares_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_new_tokens=30, seed=1234)
    alone = engine.generate(prompt="seeded", params=params).text
    noise = [BatchRequest(key=i, prompt=f"noise {i}", params=SamplingParams(temperature=1.0, max_new_tokens=30))
             for i in range(10)]
    thread = threading.Thread(target=lambda: list(engine.generate_many(noise)))
    thread.start()
    crowded = engine.generate(prompt="seeded", params=params).text
    thread.join(timeout=60)
    assert crowded == alone


def test_max_new_tokens(engine):
    result = engine.generate(prompt="count", params=SamplingParams(temperature=0.0, max_new_tokens=5))
    assert result.completion_tokens <= 5
    if result.completion_tokens == 5:
        assert result.finish_reason == "length"


def test_stop_string_ends_answer_before_it(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    full = engine.generate(prompt="stop string check", params=params)
    assert len(full.text) > 12, full.text
    stop = full.text[8:11]
    expected = full.text[: full.text.index(stop)]
    stopped = engine.stream(prompt="stop string check",
                            params=SamplingParams(temperature=0.0, max_new_tokens=60, stop=(stop,)))
    streamed = "".join(d.text for d in stopped)
    assert stopped.result.text == expected == streamed
    assert stopped.result.finish_reason == "stop"
    assert stopped.result.completion_tokens < full.completion_tokens


def test_enable_thinking_reaches_the_template(engine):
    on = engine.prepare(prompt="hi", enable_thinking=True)
    off = engine.prepare(prompt="hi", enable_thinking=False)
    tokenizer = engine.loaded.tokenizer
    assert "<think>" not in tokenizer.decode(on.token_ids)
    assert tokenizer.decode(off.token_ids).endswith("<think>\n\n</think>\n\n")
    assert engine.supports_thinking


def test_system_prompt_only_when_given(engine):
    tokenizer = engine.loaded.tokenizer
    assert "system" not in tokenizer.decode(engine.prepare(prompt="hi").token_ids)
    with_system = tokenizer.decode(engine.prepare(prompt="hi", system_prompt="Be brief.").token_ids)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_over_long_prompt_is_refused_before_any_work(engine):
    before = engine.stats().total_tokens
    with pytest.raises(PromptTooLongError, match="context holds 1024 tokens"):
        engine.stream(prompt="word " * 3000)
    assert engine.stats().total_tokens == before


def test_long_chat_drops_oldest_turns_and_says_so(engine):
    history = []
    for turn in range(12):
        history += [{"role": "user", "content": f"question {turn} " + "blah " * 60},
                    {"role": "assistant", "content": "answer " * 40}]
    history.append({"role": "user", "content": "last question"})
    result = engine.generate(messages=history, params=SamplingParams(temperature=0.0, max_new_tokens=20))
    assert result.ok
    assert any("Dropped" in notice for notice in result.notices)


def test_max_new_tokens_clamped_to_context(engine):
    prompt = "the " * 850
    assert 700 < engine.count_tokens(prompt) < 1000
    result = engine.generate(prompt=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=2000))
    assert any("lowered" in notice for notice in result.notices)
    assert result.prompt_tokens + result.completion_tokens <= 1024


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -1.0, "temperature"), ("temperature", 11.0, "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"), ("max_new_tokens", 0, "max_new_tokens"),
    ("seed", -3, "seed"), ("top_k", 2.5, "top_k"),
])
def test_invalid_sampling_values(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{field: value})


def test_bad_prompts(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.stream(prompt="   ")
    with pytest.raises(PromptError, match="role"):
        engine.stream(messages=[{"content": "no role"}])
    with pytest.raises(PromptError, match="role"):
        engine.stream(messages=[{"role": "wizard", "content": "hi"}])


def test_unknown_model_path_gives_advice(tmp_path, monkeypatch):
    from engine.engine import Engine

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="tiny-random"):
        Engine(EngineConfig(model_id=str(tmp_path / "missing-model"), device="cpu")).start()
    with pytest.raises(ModelLoadError, match="--model-id PATH"):
        Engine(EngineConfig(model_id="no-such-org/no-such-model", device="cpu")).start()


def test_loop_crash_fails_pending_then_recovers(tiny_model_path, start_engine):
    engine = start_engine(tiny_model_path)
    model = engine.loaded.model

    def explode(*_):
        raise RuntimeError("simulated fault in the forward pass")

    hook = model.register_forward_pre_hook(explode)
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda i: engine.generate(prompt=f"crash {i}", params=GREEDY), range(3)))
    finally:
        hook.remove()
    for result in results:
        assert result.finish_reason == "error"
        assert "simulated fault" in result.error
    recovered = engine.generate(prompt="after the crash", params=SamplingParams(temperature=0.0, max_new_tokens=8))
    assert recovered.ok
    assert engine.stats().restarts >= 1


def test_stats_name_a_local_model_by_its_folder_not_its_path(engine, tiny_model_path):
    import os

    shown = engine.stats()
    assert shown.model == f"{os.path.basename(tiny_model_path)} (local folder)"
    assert os.path.dirname(tiny_model_path) not in shown.as_markdown()  # the panel does not reveal the machine's paths

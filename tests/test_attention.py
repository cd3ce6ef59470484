"""The per-request attention path (engine.attention): numerics against stock sdpa, and greedy CB against generate."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch

from engine import attention, sparse_decode
from engine.attention import (
    ATTENTION_NAME,
    register_attention,
    varlen_attention_forward,
)
from engine.kv_cache import attention_needs_mask
from engine.paged_reads import PAGED_READ_KWARG, install_paged_reads

# torch warns once that CSR tensors (engine.sparse_decode) are beta
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")

HEADS, KV_HEADS, DIM = 4, 2, 16


class _Module(torch.nn.Module):
    """Stands in for an attention layer: what sdpa_attention_forward reads from it."""

    def __init__(self, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True
        self.training = False


def _cu(lengths: list[int]) -> torch.Tensor:
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)
    return torch.tensor(cumulative, dtype=torch.int32)


def _inputs(q_lens, k_lens, pad_q=0, pad_k=0, heads=HEADS, kv_heads=KV_HEADS, token_major=True, seed=0):
    """Random q/k/v for a CB batch. token_major: laid out like CB hands them (transposes of [tokens, heads, dim])."""
    generator = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q_lens) + pad_q, sum(k_lens) + pad_k

    def make(tokens, num_heads):
        if token_major:
            return torch.randn(tokens, num_heads, DIM, generator=generator).transpose(0, 1).unsqueeze(0)
        return torch.randn(1, num_heads, tokens, DIM, generator=generator)

    return make(total_q, heads), make(total_k, kv_heads), make(total_k, kv_heads)


def _stock(query, key, value, q_lens, k_lens, sliding_window=1):
    """transformers' CB without flash: one sdpa call with the block-diagonal mask CB builds."""
    from transformers.generation.continuous_batching.utils import build_attention_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = torch.empty(1, 1, query.shape[2], key.shape[2], dtype=query.dtype)
    mask.fill_(torch.finfo(query.dtype).min)
    build_attention_mask(mask, _cu(q_lens).tolist(), _cu(k_lens).tolist(), sliding_window=sliding_window)
    output, _ = sdpa_attention_forward(_Module(query.shape[1], key.shape[1]), query, key, value, mask,
                                       scaling=DIM**-0.5)
    return output


def _ours(query, key, value, q_lens, k_lens, sliding_window=None):
    output, weights = varlen_attention_forward(
        _Module(query.shape[1], key.shape[1]), query, key, value, None, scaling=DIM**-0.5, is_causal=True,
        sliding_window=sliding_window, cu_seq_lens_q=_cu(q_lens), cu_seq_lens_k=_cu(k_lens),
        max_length_q=max(q_lens), max_length_k=max(k_lens),
    )
    assert weights is None
    return output


# decode rows (q 1), fresh prefill (q == k), chunked prefill with a cached prefix (k > q), in mixed order
MIXED = ([1, 9, 6, 1, 1, 3, 1, 12], [37, 9, 50, 5, 120, 3, 64, 40])


@pytest.fixture(params=["padded", "sparse"])
def decode_strategy(request, monkeypatch):
    """Decode rows go through the padded sdpa call or the block-sparse product (chosen by size on CPU): test both,
    and check that the chosen one really ran."""
    monkeypatch.setattr(sparse_decode, "SPARSE_MIN_BYTES", 0 if request.param == "sparse" else 1 << 62)
    calls = []
    sparse = sparse_decode.decode
    monkeypatch.setattr(sparse_decode, "decode", lambda *args: calls.append(1) or sparse(*args))
    attention.clear_plan_cache()
    yield request.param
    assert bool(calls) == (request.param == "sparse")


@pytest.mark.parametrize("token_major", [True, False])
@pytest.mark.parametrize("kv_heads", [KV_HEADS, 1, HEADS])
def test_mixed_batch_matches_block_diagonal_sdpa(token_major, kv_heads, decode_strategy):
    q_lens, k_lens = MIXED
    query, key, value = _inputs(q_lens, k_lens, kv_heads=kv_heads, token_major=token_major)
    ours = _ours(query, key, value, q_lens, k_lens)
    stock = _stock(query, key, value, q_lens, k_lens)
    assert ours.shape == stock.shape == (1, sum(q_lens), HEADS, DIM)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


def test_reading_keys_through_the_paged_cache_matches():
    """engine.paged_reads hands the whole cache and the step's read index instead of the step's keys in order."""
    q_lens, k_lens = MIXED
    query, key, value = _inputs(q_lens, k_lens, seed=9)
    total_k, cache_tokens = key.shape[2], 3 * key.shape[2]
    read_index = torch.randperm(cache_tokens, generator=torch.Generator().manual_seed(1))[:total_k]

    def as_cache(states):  # the step's keys scattered over a larger cache, the rest garbage
        cache = torch.randn(cache_tokens, states.shape[1], DIM)
        cache[read_index] = states[0].transpose(0, 1)
        return cache.transpose(0, 1).unsqueeze(0)

    paged, _ = varlen_attention_forward(
        _Module(), query, as_cache(key), as_cache(value), None, scaling=DIM**-0.5, cu_seq_lens_q=_cu(q_lens),
        cu_seq_lens_k=_cu(k_lens), **{PAGED_READ_KWARG: read_index},
    )
    torch.testing.assert_close(paged, _stock(query, key, value, q_lens, k_lens), rtol=1e-5, atol=1e-5)


def test_decode_only_batch_and_uneven_lengths_are_grouped(decode_strategy):
    # Many short decode rows and a few very long ones: the rows are split into length groups
    k_lens = [20] * 30 + [900, 850] + [300] * 5 + [3, 1]
    q_lens = [1] * len(k_lens)
    query, key, value = _inputs(q_lens, k_lens, seed=3)
    attention.clear_plan_cache()
    ours = _ours(query, key, value, q_lens, k_lens)
    torch.testing.assert_close(ours, _stock(query, key, value, q_lens, k_lens), rtol=1e-5, atol=1e-5)
    plan = attention._build_plan(_cu(q_lens).tolist(), _cu(k_lens).tolist(), sum(q_lens), sum(k_lens), None,
                                 torch.device("cpu"))
    assert len(plan.decode.groups()) > 1 and not plan.prefill
    assert plan.decode.padded_slots() <= 2 * sum(k_lens)


def test_prefill_only_and_padded_batch():
    # Padding (as CUDA graphs add): empty sequences at the end, extra query and key rows
    q_lens, k_lens = [7, 5, 0, 0], [7, 40, 0, 0]
    query, key, value = _inputs(q_lens, k_lens, pad_q=5, pad_k=11)
    ours = _ours(query, key, value, q_lens, k_lens)
    stock = _stock(query, key, value, q_lens, k_lens)
    real = sum(q_lens)
    torch.testing.assert_close(ours[:, :real], stock[:, :real], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(ours[:, real:]) == 0


def test_sliding_window_matches_cb_mask(decode_strategy):
    q_lens, k_lens = MIXED
    query, key, value = _inputs(q_lens, k_lens, seed=5)
    ours = _ours(query, key, value, q_lens, k_lens, sliding_window=8)
    torch.testing.assert_close(ours, _stock(query, key, value, q_lens, k_lens, sliding_window=8), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("inference_mode", [False, True])
def test_step_plan_is_rebuilt_when_lengths_change_in_place(inference_mode):
    """The lengths written in place into the same buffer must not reuse the cached plan (inference tensors, which
    have no version counter, included: CB's loop runs in inference mode when started from inside one)."""
    q_lens, k_lens = [1, 1, 4], [10, 30, 4]
    q_lens2, k_lens2 = [2, 1, 3], [25, 15, 4]  # same totals, other layout
    query, key, value = _inputs(q_lens, k_lens)
    module = _Module()
    with torch.inference_mode(inference_mode):
        cu_q, cu_k = _cu(q_lens), _cu(k_lens)
        kwargs = {"scaling": DIM**-0.5, "cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k}
        first, _ = varlen_attention_forward(module, query, key, value, None, **kwargs)
        cu_q.copy_(_cu(q_lens2))
        cu_k.copy_(_cu(k_lens2))
        second, _ = varlen_attention_forward(module, query, key, value, None, **kwargs)
    torch.testing.assert_close(first, _stock(query, key, value, q_lens, k_lens), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, _stock(query, key, value, q_lens2, k_lens2), rtol=1e-5, atol=1e-5)


def test_outside_cb_delegates_to_stock_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, HEADS, 6, DIM, generator=generator)
    key = torch.randn(2, KV_HEADS, 6, DIM, generator=generator)
    value = torch.randn(2, KV_HEADS, 6, DIM, generator=generator)
    for mask in (None, torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()):
        ours, _ = varlen_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
        stock, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(ours, stock)


def test_unsupported_features_raise():
    q_lens, k_lens = [1], [4]
    query, key, value = _inputs(q_lens, k_lens)
    with pytest.raises(NotImplementedError, match="softcap"):
        varlen_attention_forward(_Module(), query, key, value, None, softcap=30.0, cu_seq_lens_q=_cu(q_lens),
                                 cu_seq_lens_k=_cu(k_lens))


def test_registered_name_is_accepted_by_cb_without_mask_or_fast_path(monkeypatch):
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils.generic import is_flash_attention_requested

    # Loading a "flash" name makes transformers preload it as a flash kernel unless its loader already names it
    monkeypatch.setattr(flash_utils, "_loaded_implementation", "flash_attention_2")
    assert register_attention() == register_attention() == ATTENTION_NAME  # idempotent
    assert flash_utils._loaded_implementation == ATTENTION_NAME
    assert ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is varlen_attention_forward
    assert ATTENTION_NAME in ALL_MASK_ATTENTION_FUNCTIONS
    # CB accepts it (a flash name), but it is no hub kernel and never selects the flash decode fast path
    assert is_flash_attention_requested(requested_attention_implementation=ATTENTION_NAME)
    assert not is_flash_attention_requested(requested_attention_implementation=ATTENTION_NAME, version=[2, 3])
    assert not is_kernel(ATTENTION_NAME)

    class Config:
        _attn_implementation = ATTENTION_NAME

    assert not attn_mask_is_needed(Config())
    assert attention_needs_mask(ATTENTION_NAME) is False
    assert all(attention_needs_mask(name) for name in ("sdpa", "eager", "paged|eager"))
    assert not attention_needs_mask("flash_attention_2")


# ------------------------------------------------------------------------------------------------------ end to end --


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from engine.tiny_model import build_tiny_model

    folder = tmp_path_factory.mktemp("attention-models")
    models = {arch: build_tiny_model(folder / arch, architecture=arch) for arch in ("qwen2", "llama")}
    # A hybrid model: sliding-window layers next to full ones (two cache groups, two cu_seq_lens_k per step)
    config = Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.5, use_sliding_window=True,
        sliding_window=24, layer_types=["full_attention", "sliding_attention"] * 2, eos_token_id=0, pad_token_id=0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder / "qwen2-sliding")
    models["qwen2-sliding"] = folder / "qwen2-sliding"
    return models


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_attention()).eval()


def _prompts(vocab_size: int):
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 5, 9, 17, 30, 41, 64, 65, 80, 100, 130, 150, 7, 12, 25, 90, 2, 48, 70, 110]
    answers = [1, 12, 30, 5, 20, 8, 16, 25, 3, 30, 10, 18, 28, 2, 22, 14, 30, 9, 6, 24]
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    # Two prompts sharing a 70-token prefix (over two 32-token pages): prefix caching can skip part of a prefill
    prompts += [[*prompts[9][:70], 5, 6, 7], [*prompts[9][:70], 8, 9]]
    answers += [15, 11]
    return prompts, answers


def _serve_with_cb(model, prompts, answers, inference_mode: bool, paged_reads: bool) -> dict[int, list[int]]:
    """Raw CB with a small batch budget (64 tokens: long prompts are prefilled in chunks); EOS off. With
    `paged_reads`, the cache hands the attention itself (engine.paged_reads), as in the engine."""
    from transformers import ContinuousBatchingConfig

    generation_config = copy.deepcopy(model.generation_config)
    generation_config.do_sample = False
    generation_config.temperature = generation_config.top_p = generation_config.top_k = None
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=160, max_batch_tokens=64, page_size=32),
    )
    if paged_reads:
        manager.warmup()  # builds the cache, as the engine does before installing paged reads
        assert install_paged_reads(manager.batch_processor.cache)
    with torch.inference_mode(inference_mode):  # the loop thread inherits the caller's inference mode
        manager.start()
    try:
        for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=answer, eos_token_id=-1)
        results: dict[int, list[int]] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(prompts) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                assert result.error is None, result.error
                results[int(result.request_id[1:])] = list(result.generated_tokens)
        assert manager.batch_processor.inputs_and_outputs.attention_mask is None  # CB allocated no mask
    finally:
        manager.stop(block=True, timeout=30)
    resolved = manager.continuous_batching_config
    assert resolved.max_blocks_per_request == 0  # no flash decode fast path
    assert not any(resolved.cuda_graph_booleans)
    return results


@pytest.mark.parametrize(
    ("arch", "inference_mode", "force_sparse", "paged_reads"),
    [("qwen2", False, False, True), ("llama", True, False, True), ("qwen2-sliding", False, False, True),
     ("qwen2-sliding", False, True, True), ("qwen2", False, False, False), ("qwen2", False, True, False)],
)
def test_cb_greedy_equals_generate(tiny_models, arch, inference_mode, force_sparse, paged_reads, monkeypatch):
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    calls = {"plans": 0, "paged": 0, "copied": 0, "sparse": 0}
    if force_sparse:  # the tiny models' batches are far below the size where the sparse decode path kicks in
        monkeypatch.setattr(sparse_decode, "SPARSE_MIN_BYTES", 0)
        sparse = sparse_decode.decode
        monkeypatch.setattr(sparse_decode, "decode", lambda *args: calls.update(sparse=calls["sparse"] + 1)
                            or sparse(*args))
    build_plan = attention._build_plan
    varlen = attention._varlen_attention

    def counting_build_plan(*args, **kwargs):
        calls["plans"] += 1
        return build_plan(*args, **kwargs)

    def counting_varlen(*args):
        calls["paged" if args[-1] is not None else "copied"] += 1
        return varlen(*args)

    monkeypatch.setattr(attention, "_build_plan", counting_build_plan)
    monkeypatch.setattr(attention, "_varlen_attention", counting_varlen)
    model = _load(tiny_models[arch])
    assert model.config._attn_implementation == ATTENTION_NAME
    prompts, answers = _prompts(model.config.vocab_size)
    results = _serve_with_cb(model, prompts, answers, inference_mode, paged_reads)
    assert len(results) == len(prompts)
    assert calls["plans"] > 0  # CB really went through the per-request path
    # Layers read the paged cache directly exactly when paged reads are installed (first prefills have no cache)
    assert (calls["paged"] > 0) == paged_reads and calls["copied"] > 0
    # Forced, the sparse product serves the decode rows whose keys arrive as CB's copy (with paged reads: the
    # sliding-window layers only)
    assert (calls["sparse"] > 0) == force_sparse
    assert model.config._attn_implementation == ATTENTION_NAME  # CB did not switch it

    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=answer, do_sample=False, eos_token_id=-1, pad_token_id=0)
        assert results[index] == output[0, len(prompt):].tolist(), f"request {index} ({len(prompt)} prompt tokens)"


def test_generate_with_padding_matches_sdpa(tiny_models):
    """Outside CB the name behaves like sdpa, left padding (a real 2D mask) included."""
    from transformers import AutoModelForCausalLM

    ours = _load(tiny_models["qwen2"])
    stock = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], attn_implementation="sdpa").eval()
    input_ids = torch.tensor([[0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(input_ids, **kwargs), stock.generate(input_ids, **kwargs))

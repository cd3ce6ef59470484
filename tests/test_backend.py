"""Backend selection for every branch, with the machine's facts injected instead of the hardware."""

from __future__ import annotations

import pytest

from engine.backend import METAL_FLASH_KERNEL, PER_REQUEST_ATTENTION, DeviceFacts, select_backend
from engine.config import EngineConfig

GIB = 1024**3
CUDA = DeviceFacts(cuda_available=True, cuda_device_name="H200", cuda_bf16_supported=True, cuda_free_bytes=100 * GIB)


def test_cuda_with_flash_lets_cb_switch_from_sdpa():
    choice = select_backend(EngineConfig(), DeviceFacts(**{**CUDA.__dict__, "flash_attn_available": True}))
    assert (choice.device, choice.dtype, choice.attn_implementation) == ("cuda", "bfloat16", "sdpa")
    assert "flash" in choice.reasons["attention"]
    assert choice.page_size == 256 and choice.kv_cache_bytes is None  # sized from free memory after loading


def test_cuda_without_flash():
    choice = select_backend(EngineConfig(), CUDA)
    assert choice.device == "cuda" and choice.attn_implementation == "sdpa"
    assert "no flash" in choice.reasons["attention"]


def test_cuda_without_bf16_uses_fp16():
    facts = DeviceFacts(**{**CUDA.__dict__, "cuda_bf16_supported": False})
    choice = select_backend(EngineConfig(), facts)
    assert choice.dtype == "float16" and "no bf16" in choice.reasons["dtype"]


def test_mps_with_usable_kernels_uses_metal_flash():
    facts = DeviceFacts(mps_available=True, kernels_installed="0.18.2", kernels_usable=True)
    choice = select_backend(EngineConfig(), facts)
    assert (choice.device, choice.dtype, choice.attn_implementation) == ("mps", "float16", METAL_FLASH_KERNEL)
    assert choice.page_size == 32
    assert "--attn-implementation sdpa" in choice.reasons["attention"]


def test_mps_without_kernels_falls_back_and_says_why():
    choice = select_backend(EngineConfig(), DeviceFacts(mps_available=True, kernels_installed=None))
    assert choice.attn_implementation != METAL_FLASH_KERNEL
    assert "not installed" in choice.reasons["attention"]


def test_mps_with_too_old_kernels_falls_back_and_says_why():
    facts = DeviceFacts(mps_available=True, kernels_installed="0.17.2", kernels_usable=False)
    choice = select_backend(EngineConfig(), facts)
    assert choice.attn_implementation != METAL_FLASH_KERNEL
    assert "0.17.2 is too old" in choice.reasons["attention"] and "0.18.2" in choice.reasons["attention"]


def test_cpu_sizes_cache_and_batch_tokens_explicitly():
    choice = select_backend(EngineConfig(), DeviceFacts(ram_available_bytes=16 * GIB))
    assert (choice.device, choice.dtype, choice.attn_implementation) == ("cpu", "float32", PER_REQUEST_ATTENTION)
    assert choice.max_batch_tokens == 256  # not CB's 8192 default, which can crash the loop on CPU
    assert choice.max_batch_inflight == 64  # a quarter of a step's tokens
    assert choice.kv_cache_bytes == int(16 * GIB * 0.2)
    assert choice.page_size == 32


def test_explicit_choices_always_win():
    facts = DeviceFacts(mps_available=True, kernels_installed="0.18.2", kernels_usable=True)
    choice = select_backend(EngineConfig(attn_implementation="sdpa", dtype="float32", kv_cache_gib=1.5,
                                         max_batch_tokens=256, page_size=64), facts)
    assert (choice.attn_implementation, choice.dtype) == ("sdpa", "float32")
    assert "asked for" in choice.reasons["attention"]
    assert (choice.kv_cache_bytes, choice.max_batch_tokens, choice.page_size) == (int(1.5 * GIB), 256, 64)


def test_explicit_device_that_is_missing_is_an_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        select_backend(EngineConfig(device="cuda"), DeviceFacts())
    with pytest.raises(ValueError, match="Metal"):
        select_backend(EngineConfig(device="mps"), DeviceFacts())


def test_summary_names_choices_and_reasons():
    line = select_backend(EngineConfig(), DeviceFacts()).summary()
    assert "device=cpu" in line and "dtype=float32" in line and "attention=" in line


def test_per_request_alias_and_stock_opt_out():
    assert select_backend(EngineConfig(attn_implementation="cbs_varlen"), DeviceFacts()).attn_implementation == \
        PER_REQUEST_ATTENTION
    assert select_backend(EngineConfig(attn_implementation="sdpa"), DeviceFacts()).attn_implementation == "sdpa"


def test_cpu_allocator_tuning_only_on_glibc_cpu_and_switchable_off():
    on_glibc = DeviceFacts(glibc=True)
    assert select_backend(EngineConfig(), on_glibc).tune_cpu_allocator
    off = select_backend(EngineConfig(cpu_allocator_tuning=False), on_glibc)
    assert not off.tune_cpu_allocator and "--cpu-allocator-tuning off" in off.reasons["allocator"]
    assert not select_backend(EngineConfig(), DeviceFacts(glibc=False)).tune_cpu_allocator
    assert not select_backend(EngineConfig(), DeviceFacts(**{**CUDA.__dict__, "glibc": True})).tune_cpu_allocator


def test_keep_freed_buffers_applies_on_this_glibc_machine():
    from engine.allocator import glibc_available, keep_freed_buffers

    if not glibc_available():
        pytest.skip("the tuning is for glibc; this machine has another C library")
    assert keep_freed_buffers() is True  # glibc accepted both mallopt settings (it returns 0 for a bad value)


def test_cpu_runs_a_bf16_checkpoint_in_bf16_only_where_the_cpu_computes_bf16():
    native = DeviceFacts(cpu_bf16=True)
    choice = select_backend(EngineConfig(), native, checkpoint_dtype="bfloat16")
    assert choice.dtype == "bfloat16" and "natively" in choice.reasons["dtype"]
    assert select_backend(EngineConfig(), native, checkpoint_dtype="float32").dtype == "float32"
    assert select_backend(EngineConfig(), native, checkpoint_dtype=None).dtype == "float32"
    emulated = select_backend(EngineConfig(), DeviceFacts(cpu_bf16=False), checkpoint_dtype="bfloat16")
    assert emulated.dtype == "float32" and "no native bf16" in emulated.reasons["dtype"]
    assert select_backend(EngineConfig(dtype="float32"), native, checkpoint_dtype="bfloat16").dtype == "float32"


def test_dataset_rows_are_capped_while_a_chat_streams_on_cpu_only():
    assert select_backend(EngineConfig(), DeviceFacts()).dataset_tokens_while_chatting == 256 // 8
    assert select_backend(EngineConfig(max_batch_tokens=1024), DeviceFacts()).dataset_tokens_while_chatting == 128
    assert select_backend(EngineConfig(), CUDA).dataset_tokens_while_chatting is None
    asked = select_backend(EngineConfig(dataset_tokens_while_chatting=256), DeviceFacts())
    assert asked.dataset_tokens_while_chatting == 256 and "asked for" in asked.reasons["chat_priority"]

"""Backend selection: which device, dtype, attention and cache geometry to use, and why.

`select_backend(config, facts)` is a pure function of the user's configuration and the facts about the machine
(`DeviceFacts`), so every branch is unit-tested without the hardware. `probe_device_facts()` reads the facts from
torch and transformers; it is the only function here that imports them.

The rules (each decision carries its reason, logged at startup like `transformers serve` does):
- CUDA: bf16 where the GPU supports it, else fp16; attention `sdpa`, which transformers' continuous batching
  switches to flash attention itself when flash-attn or a kernels flash build is usable. (Our per-request path is
  opt-in there until it is measured on a GPU.)
- MPS: fp16; `kernels-community/metal-flash-sdpa` when transformers reports `kernels` usable, else sdpa with the
  reason (kernels missing, or too old for this transformers); page size 32 (256 is ~17x slower on MPS,
  transformers PR #46792).
- CPU: bf16 when the checkpoint is bf16 and the CPU computes bf16 natively (about 2x fp32 for a Qwen2.5-0.5B shape),
  else fp32; our per-request attention (engine.attention: no block-diagonal mask, measured 2.3-3.5x the stock
  path), explicit cache size and 256 batch tokens (the 8192 default can crash the loop); on glibc, malloc keeps
  the buffers each step frees (engine.allocator).
- CPU, while a chat streams: dataset rows get at most an eighth of the step's tokens (engine.scheduler), since a
  CPU step costs about its tokens.
- An explicit `--attn-implementation` (or dtype, device) always wins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .allocator import glibc_available
from .config import EngineConfig

logger = logging.getLogger(__name__)

METAL_FLASH_KERNEL = "kernels-community/metal-flash-sdpa"
# engine.attention's per-request path. "flash" in the name is what makes CB accept it (and skip its mask); the
# missing version digit keeps CB off the flash decode fast path. See engine/attention.py.
PER_REQUEST_ATTENTION = "cbs_varlen_noflash"
PER_REQUEST_ALIASES = ("cbs_varlen", PER_REQUEST_ATTENTION)
GIB = 1024**3
CPU_CHAT_CAP_DIVISOR = 8  # dataset tokens per step while a chat streams on CPU: the batch tokens / this


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine offers, as far as backend selection cares."""

    cuda_available: bool = False
    cuda_device_name: str | None = None
    cuda_bf16_supported: bool = False
    cuda_free_bytes: int = 0
    mps_available: bool = False
    flash_attn_available: bool = False  # flash-attn 2/3 importable, or a kernels flash build usable
    kernels_installed: str | None = None  # version of the `kernels` package, None when not installed
    kernels_required: str = "0.18.2"  # the minimum this transformers accepts
    kernels_usable: bool = False  # transformers' is_kernels_available()
    ram_available_bytes: int = 8 * GIB
    glibc: bool = False  # the C library is glibc, whose malloc engine.allocator tunes
    cpu_bf16: bool = False  # the CPU computes bf16 natively (AVX512-BF16 or AMX)


@dataclass(frozen=True)
class BackendChoice:
    """The decision, with one human-readable reason per choice."""

    device: str
    dtype: str
    attn_implementation: str
    page_size: int
    max_batch_tokens: int
    kv_cache_bytes: int | None  # None: size from free device memory after the model loads (CUDA)
    kv_cache_fraction: float  # share of free memory for the cache when kv_cache_bytes is None
    max_batch_inflight: int
    dataset_tokens_while_chatting: int | None = None  # engine.scheduler's cap on dataset tokens while a chat streams
    tune_cpu_allocator: bool = False  # engine.allocator.keep_freed_buffers() at startup
    reasons: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """The startup line: what was chosen, why, and how to opt out."""
        parts = [f"device={self.device} ({self.reasons.get('device', '')})",
                 f"dtype={self.dtype} ({self.reasons.get('dtype', '')})",
                 f"attention={self.attn_implementation} ({self.reasons.get('attention', '')})"]
        return "Backend: " + "; ".join(parts)


def _choose_device(config: EngineConfig, facts: DeviceFacts) -> tuple[str, str]:
    if config.device != "auto":
        if config.device.startswith("cuda") and not facts.cuda_available:
            raise ValueError(f"device={config.device!r} was asked for but no CUDA device is visible; "
                             "use --device cpu or --device auto")
        if config.device == "mps" and not facts.mps_available:
            raise ValueError("device='mps' was asked for but Apple's Metal backend is not available; "
                             "use --device cpu or --device auto")
        return config.device, "asked for with --device"
    if facts.cuda_available:
        return "cuda", f"CUDA GPU found ({facts.cuda_device_name or 'unknown'})"
    if facts.mps_available:
        return "mps", "Apple Silicon GPU (Metal) found"
    return "cpu", "no GPU found"


def _choose_dtype(config: EngineConfig, facts: DeviceFacts, device: str,
                  checkpoint_dtype: str | None) -> tuple[str, str]:
    if config.dtype != "auto":
        return config.dtype, "asked for with --dtype"
    if device.startswith("cuda"):
        if facts.cuda_bf16_supported:
            return "bfloat16", "the GPU supports bf16"
        return "float16", "the GPU has no bf16 support"
    if device == "mps":
        return "float16", "fp16 is the fast path on Metal"
    if checkpoint_dtype == "bfloat16":
        if facts.cpu_bf16:
            # Decode on CPU reads every weight at every step: bf16 halves the bytes. Qwen2.5-0.5B shape, 2 cores:
            # 1.9-2.15x the engine's fp32 tokens/s (three alternating pairs, bench.throughput --dtype auto|float32).
            return "bfloat16", ("the checkpoint is bf16 and this CPU computes bf16 natively (about 2x fp32 "
                                "throughput measured for a Qwen2.5-0.5B shape); --dtype float32 for fp32")
        return "float32", "this CPU has no native bf16 (AVX512-BF16/AMX): the bf16 checkpoint runs in fp32"
    return "float32", "the checkpoint is not bf16: fp32, exact and fast on CPU"


def _kernels_reason(facts: DeviceFacts) -> str:
    if facts.kernels_installed is None:
        return f"the `kernels` package is not installed (pip install 'kernels>={facts.kernels_required}')"
    return (f"kernels {facts.kernels_installed} is too old for this transformers "
            f"(needs >= {facts.kernels_required})")


def _choose_attention(config: EngineConfig, facts: DeviceFacts, device: str) -> tuple[str, str]:
    if config.attn_implementation in PER_REQUEST_ALIASES:
        return PER_REQUEST_ATTENTION, "asked for with --attn-implementation: per-request sdpa attention"
    if config.attn_implementation != "auto":
        return config.attn_implementation, "asked for with --attn-implementation"
    if device.startswith("cuda"):
        if facts.flash_attn_available:
            return "sdpa", "flash attention is usable: continuous batching switches sdpa to it by itself"
        return "sdpa", ("no flash attention installed: transformers' paged sdpa (the per-request path, "
                        "--attn-implementation cbs_varlen, is not yet measured on GPUs)")
    if device == "mps":
        if facts.kernels_usable:
            return METAL_FLASH_KERNEL, "Metal flash kernel served by `kernels` (opt out: --attn-implementation sdpa)"
        return "sdpa", (f"Metal flash kernel unavailable: {_kernels_reason(facts)}; transformers' paged sdpa (or "
                        "--attn-implementation cbs_varlen, not yet measured on Metal)")
    return PER_REQUEST_ATTENTION, ("CPU: per-request sdpa attention, no block-diagonal mask (measured 2.3-3.5x "
                                   "transformers' sdpa path); --attn-implementation sdpa gives the stock path")


def select_backend(config: EngineConfig, facts: DeviceFacts, checkpoint_dtype: str | None = None) -> BackendChoice:
    """Decide device, dtype, attention and cache geometry from the config, the machine's facts and the dtype the
    checkpoint declares (engine.loader.inspect_checkpoint)."""
    device, device_reason = _choose_device(config, facts)
    dtype, dtype_reason = _choose_dtype(config, facts, device, checkpoint_dtype)
    attention, attention_reason = _choose_attention(config, facts, device)
    on_cuda = device.startswith("cuda")
    page_size = config.page_size or (256 if on_cuda else 32)
    # CPU: 256, not CB's 8192 (which can leave a few cache blocks or crash the loop). Against 512, throughput was
    # the same within this machine's noise and chat TTFT during a dataset job 56 vs 93 ms (bench.latency).
    max_batch_tokens = config.max_batch_tokens or (2048 if on_cuda else 1024 if device == "mps" else 256)
    if config.kv_cache_gib is not None:
        kv_bytes: int | None = int(config.kv_cache_gib * GIB)
        cache_reason = f"{config.kv_cache_gib:g} GiB asked for with --kv-cache-gib"
    elif on_cuda:
        kv_bytes = None
        cache_reason = "half of the GPU memory left free once the model is loaded"
    else:
        # CPU and MPS share RAM with everything else: a fifth of what is available, at most 4 GiB.
        kv_bytes = int(min(4 * GIB, max(facts.ram_available_bytes, GIB) * 0.2))
        cache_reason = f"{kv_bytes / GIB:.2f} GiB: a fifth of available RAM, capped at 4 GiB"
    # A quarter of a step's tokens: dataset rows decode in at most that many slots, which leaves three quarters of
    # every step for prefills, where a chat request goes first (engine.scheduler). Measured on CPU: 64 rows cost
    # ~15% throughput against 128 on a 96-request job (bench.throughput --max-batch-inflight).
    inflight = config.max_batch_inflight or max(16, max_batch_tokens // 4)
    chat_cap, chat_cap_reason = _choose_chat_priority(config, device, max_batch_tokens)
    tune_allocator, allocator_reason = _choose_allocator_tuning(config, facts, device)
    reasons = {"device": device_reason, "dtype": dtype_reason, "attention": attention_reason, "kv_cache": cache_reason,
               "allocator": allocator_reason, "chat_priority": chat_cap_reason}
    return BackendChoice(device=device, dtype=dtype, attn_implementation=attention, page_size=page_size,
                         max_batch_tokens=max_batch_tokens, kv_cache_bytes=kv_bytes, kv_cache_fraction=0.5,
                         max_batch_inflight=inflight, dataset_tokens_while_chatting=chat_cap,
                         tune_cpu_allocator=tune_allocator, reasons=reasons)


def _choose_chat_priority(config: EngineConfig, device: str, max_batch_tokens: int) -> tuple[int | None, str]:
    if config.dataset_tokens_while_chatting is not None:
        return config.dataset_tokens_while_chatting, "asked for with --dataset-tokens-while-chatting"
    if device == "cpu":
        cap = max(8, max_batch_tokens // CPU_CHAT_CAP_DIVISOR)
        # Qwen2.5-0.5B shape in bf16, 2 cores, bench.latency: chat 297 ms per token during a job with a cap of 32,
        # 1,013 ms without (123-131 ms idle); the job made 13.6 instead of 27.9 tok/s while the chats streamed.
        return cap, (f"CPU steps cost about their tokens: while a chat streams, dataset rows get at most {cap} "
                     "tokens per step (measured: the chat 3.4x faster, the job half as fast only meanwhile)")
    return None, "no cap: not measured on this device yet"


def _choose_allocator_tuning(config: EngineConfig, facts: DeviceFacts, device: str) -> tuple[bool, str]:
    if device != "cpu":
        return False, "not needed: the step's tensors live on the accelerator"
    if config.cpu_allocator_tuning is False:
        return False, "turned off with --cpu-allocator-tuning off"
    if not facts.glibc:
        return False, "not glibc: the C library's own malloc policy is kept"
    return True, ("glibc keeps freed step buffers for the next step (measured on 2 cores: 1.07-1.31x tokens/s, "
                  "a third of the system time); --cpu-allocator-tuning off to disable")


def probe_device_facts() -> DeviceFacts:
    """Read the machine's facts from torch, transformers and psutil."""
    import importlib.metadata

    import psutil
    import torch
    from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown
    from transformers.utils import import_utils

    cuda = torch.cuda.is_available()
    flash = False
    if cuda:
        flash = bool(import_utils.is_flash_attn_3_available() or import_utils.is_flash_attn_2_available())
    try:
        kernels_version: str | None = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        kernels_version = None
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    # What CB itself will count as free RAM: it honours NUMA/cgroup limits that psutil's `available` ignores.
    _, total, reserved, allocated = get_device_and_memory_breakdown()
    ram_available = min(int(psutil.virtual_memory().available), max(int(total) - max(reserved, allocated), 0))
    return DeviceFacts(
        cuda_available=cuda,
        cuda_device_name=torch.cuda.get_device_name(0) if cuda else None,
        cuda_bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        cuda_free_bytes=torch.cuda.mem_get_info()[0] if cuda else 0,
        mps_available=mps,
        flash_attn_available=flash,
        kernels_installed=kernels_version,
        kernels_required=import_utils.KERNELS_MIN_VERSION,
        kernels_usable=bool(import_utils.is_kernels_available()),
        ram_available_bytes=ram_available,
        glibc=glibc_available(),
        cpu_bf16=_cpu_computes_bf16(torch),
    )


def _cpu_computes_bf16(torch) -> bool:
    """AVX512-BF16 or AMX, from torch's own CPU probes (private: absent ones count as no, never as a crash)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)

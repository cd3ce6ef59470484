"""Validated configuration: what engine to build (`EngineConfig`) and how to sample one request (`SamplingParams`).

This is the one place where command-line flags and environment variables become configuration: `app.py` and
`engine.cli` both call `add_engine_arguments` and `engine_config_from_args`. Every value is checked when the
dataclass is built; a bad one raises `ValueError` naming the field, the value and what is allowed.

No torch here: importing this module is instant, so `--help` answers without loading anything.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

DEFAULT_MODEL_ID = "Qwen/Qwen2.5-0.5B-Instruct"
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# Our own per-request attention path (engine.attention) next to the names transformers' CB accepts.
ATTENTION_CHOICES = ("auto", "sdpa", "paged|eager", "cbs_varlen (ours: per-request sdpa)", "flash_attention_2",
                     "flash_attention_3", "kernels-community/metal-flash-sdpa")
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 10.0


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is not valid: {allowed}.")


def _check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, f"expected a whole number >= {low}" + (f" and <= {high}" if high else ""))
    if value < low or (high is not None and value > high):
        _fail(name, value, f"must be >= {low}" + (f" and <= {high}" if high else ""))


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        _fail(name, value, f"expected a number in {'(' if low_open else '['}{low}, {high}]")
    if value < low or value > high or (low_open and value == low):
        _fail(name, value, f"must be in {'(' if low_open else '['}{low}, {high}]")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. `None` means "the model's own default" (its generation_config).

    Attributes:
        temperature: 0 means greedy decoding (token for token what `model.generate` gives); up to 10.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 disables the filter.
        max_new_tokens: at most this many generated tokens (clamped to the room left in the model's context).
        stop: strings that end the answer at their first occurrence; the stop string is left out of the text.
        seed: makes sampling reproducible for this request, whatever else runs in the same batch.
        ignore_eos: keep generating past the end-of-turn token up to max_new_tokens (for benchmarks).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature is not None:
            _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.top_p is not None:
            _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, allow_none=True)
        _check_int("max_new_tokens", self.max_new_tokens, 1, allow_none=True)
        _check_int("seed", self.seed, 0, 2**63 - 1, allow_none=True)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            _fail("stop", self.stop, "expected a list of strings")
        stop = tuple(s for s in stop if s)  # an empty stop string would end every answer at once: ignore it
        if len(stop) > MAX_STOP_STRINGS:
            _fail("stop", self.stop, f"at most {MAX_STOP_STRINGS} stop strings")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """What the process-wide engine loads and how it sizes itself. `auto` fields are decided by `engine.backend`.

    Attributes:
        model_id: a Hub model id, a local folder, or `tiny-random` (an offline random model, see engine.tiny_model).
        revision: Hub revision (branch, tag or commit) to load.
        device: auto | cpu | cuda | cuda:N | mps.
        dtype: auto | float32 | float16 | bfloat16.
        attn_implementation: auto, or an explicit implementation, which always wins over the automatic choice.
        kv_cache_gib: memory for the paged KV cache in GiB; None sizes it from the device (see engine.backend).
        max_batch_tokens: tokens per forward step (prefill chunks plus one per decoding request); None = per backend.
        page_size: tokens per KV-cache page; None = per backend (32 on MPS and CPU, 256 on CUDA).
        max_new_tokens: default answer length when a request does not say.
        max_batch_inflight: dataset rows handed to the scheduler at once; the rest wait in the engine, so a chat
            request is admitted after at most this many rows. None = a quarter of max_batch_tokens.
        dataset_tokens_while_chatting: while a chat streams, dataset rows get at most this many tokens of each step
            (chat tokens go first), so the chat keeps its speed; None = per backend (an eighth of the batch
            tokens on CPU, no cap elsewhere); the batch tokens value turns the cap off.
        use_cuda_graph: CUDA graphs for the forward step on CUDA; None lets transformers decide.
        cpu_allocator_tuning: on CPU with glibc, keep the buffers each step frees for the next step instead of
            returning them to the kernel (engine.allocator); None = on wherever it applies.
        trust_remote_code: run custom modelling code from the model repository (off unless you trust it).
    """

    model_id: str = DEFAULT_MODEL_ID
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "auto"
    kv_cache_gib: float | None = None
    max_batch_tokens: int | None = None
    page_size: int | None = None
    max_new_tokens: int = 512
    max_batch_inflight: int | None = None
    dataset_tokens_while_chatting: int | None = None
    use_cuda_graph: bool | None = None
    cpu_allocator_tuning: bool | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            _fail("model_id", self.model_id, "give a Hub model id, a local folder, or tiny-random")
        device = self.device
        if not (device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit())):
            _fail("device", device, f"choose one of {', '.join(DEVICES)} or cuda:N")
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"choose one of {', '.join(DTYPES)}")
        if not isinstance(self.attn_implementation, str) or not self.attn_implementation:
            _fail("attn_implementation", self.attn_implementation, f"e.g. {', '.join(ATTENTION_CHOICES)}")
        if self.kv_cache_gib is not None:
            _check_float("kv_cache_gib", self.kv_cache_gib, 0.0, 4096.0, low_open=True)
        _check_int("max_batch_tokens", self.max_batch_tokens, 16, 1 << 20, allow_none=True)
        _check_int("page_size", self.page_size, 4, 4096, allow_none=True)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("max_batch_inflight", self.max_batch_inflight, 1, allow_none=True)
        _check_int("dataset_tokens_while_chatting", self.dataset_tokens_while_chatting, 1, allow_none=True)

    def with_overrides(self, **changes) -> EngineConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Flags and environment variables, in one place.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Option:
    field_name: str
    flag: str
    env: str
    kind: type
    help: str
    choices: Sequence[str] | None = None
    extra: dict = field(default_factory=dict)


ENGINE_OPTIONS: tuple[_Option, ...] = (
    _Option("model_id", "--model-id", "MODEL_ID", str,
            f"Hub model id, local folder, or 'tiny-random' (offline random model). Default {DEFAULT_MODEL_ID}."),
    _Option("revision", "--revision", "MODEL_REVISION", str, "Hub revision (branch, tag or commit)."),
    _Option("device", "--device", "DEVICE", str, "auto, cpu, cuda, cuda:N or mps."),
    _Option("dtype", "--dtype", "DTYPE", str, "auto, float32, float16 or bfloat16.", DTYPES),
    _Option("attn_implementation", "--attn-implementation", "ATTN_IMPLEMENTATION", str,
            "Attention implementation; an explicit value always wins over auto. "
            f"Known: {', '.join(ATTENTION_CHOICES)}."),
    _Option("kv_cache_gib", "--kv-cache-gib", "KV_CACHE_GIB", float, "KV-cache memory budget in GiB (auto if unset)."),
    _Option("max_batch_tokens", "--max-batch-tokens", "MAX_BATCH_TOKENS", int,
            "Tokens per forward step (auto: 256 on CPU, 1024 on MPS, 2048 on CUDA)."),
    _Option("page_size", "--page-size", "PAGE_SIZE", int, "Tokens per KV-cache page (auto: 32 CPU/MPS, 256 CUDA)."),
    _Option("max_new_tokens", "--default-max-new-tokens", "DEFAULT_MAX_NEW_TOKENS", int,
            "Answer length when a request does not set one."),
    _Option("max_batch_inflight", "--max-batch-inflight", "MAX_BATCH_INFLIGHT", int,
            "Dataset rows handed to the scheduler at once; chat requests wait behind at most this many."),
    _Option("dataset_tokens_while_chatting", "--dataset-tokens-while-chatting", "DATASET_TOKENS_WHILE_CHATTING", int,
            "While a chat streams, dataset rows get at most this many tokens per step (auto: an eighth of the "
            "batch tokens on CPU, no cap elsewhere)."),
    _Option("use_cuda_graph", "--cuda-graph", "CUDA_GRAPH", bool, "on/off: CUDA graphs (auto: transformers decides)."),
    _Option("cpu_allocator_tuning", "--cpu-allocator-tuning", "CPU_ALLOCATOR_TUNING", bool,
            "on/off: on CPU with glibc, reuse freed step buffers instead of page-faulting new ones (auto: on)."),
    _Option("trust_remote_code", "--trust-remote-code", "TRUST_REMOTE_CODE", bool,
            "Run modelling code shipped with the model repository."),
)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected on/off, true/false or 1/0, got {text!r}")


def _env_default(option: _Option, environ) -> object | None:
    raw = environ.get(option.env)
    if raw is None or raw == "":
        return None
    try:
        return parse_bool(raw) if option.kind is bool else option.kind(raw)
    except ValueError as error:
        raise ValueError(f"environment variable {option.env}={raw!r}: {error}") from None


def _add_options(group, options: tuple[_Option, ...], environ) -> None:
    """One flag per option; its default comes from the option's environment variable when set."""
    for option in options:
        default = _env_default(option, environ)
        help_text = f"{option.help} [{option.env}]"
        if option.field_name == "trust_remote_code":
            group.add_argument(option.flag, dest=option.field_name, action="store_true", default=bool(default),
                               help=help_text)
        elif option.kind is bool:
            group.add_argument(option.flag, dest=option.field_name, type=parse_bool, default=default,
                               metavar="on|off", help=help_text)
        else:
            group.add_argument(option.flag, dest=option.field_name, type=option.kind, default=default,
                               choices=option.choices, help=help_text)


def add_engine_arguments(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """Add the engine flags to a parser; each flag's default comes from its environment variable when set."""
    group = parser.add_argument_group("engine", "Model and backend (each flag also reads the environment variable "
                                                "shown in brackets)")
    _add_options(group, ENGINE_OPTIONS, environ)


def _config_from_args(cls, args: argparse.Namespace):
    known = {f.name for f in fields(cls)}
    return cls(**{name: value for name, value in vars(args).items() if name in known and value is not None})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig from parsed flags (flags already carry the environment defaults)."""
    return _config_from_args(EngineConfig, args)


@dataclass(frozen=True)
class AppConfig:
    """How the web app is served (engine settings live in EngineConfig).

    Attributes:
        host / port / share: where Gradio listens; share opens a public gradio.live link.
        max_rows: most rows one dataset job may run (a Space sets this for its visitors); None = no limit.
        max_file_size_mb: largest upload accepted.
        chat_concurrency: chat requests served at once (None = no limit: all are batched together in the engine).
    """

    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    max_rows: int | None = None
    max_file_size_mb: float = 100.0
    chat_concurrency: int | None = None

    def __post_init__(self) -> None:
        _check_int("port", self.port, 1, 65535)
        _check_int("max_rows", self.max_rows, 1, allow_none=True)
        _check_float("max_file_size_mb", self.max_file_size_mb, 0.0, 1e6, low_open=True)
        _check_int("chat_concurrency", self.chat_concurrency, 1, allow_none=True)


APP_OPTIONS: tuple[_Option, ...] = (
    _Option("host", "--host", "HOST", str, "Interface to listen on (0.0.0.0 to accept other machines)."),
    _Option("port", "--port", "PORT", int, "Port to listen on."),
    _Option("share", "--share", "SHARE", bool, "on/off: also serve through a public gradio.live link."),
    _Option("max_rows", "--max-rows", "MAX_ROWS", int, "Most rows one dataset job may run (unlimited if unset)."),
    _Option("max_file_size_mb", "--max-file-size-mb", "MAX_FILE_SIZE_MB", float, "Largest upload, in MB."),
    _Option("chat_concurrency", "--chat-concurrency", "CHAT_CONCURRENCY", int,
            "Chat requests served at once (unlimited if unset: the engine batches them together)."),
)


def add_app_arguments(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    group = parser.add_argument_group("app", "Web server (each flag also reads the environment variable shown)")
    _add_options(group, APP_OPTIONS, environ)


def app_config_from_args(args: argparse.Namespace) -> AppConfig:
    return _config_from_args(AppConfig, args)

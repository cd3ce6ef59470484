"""Loading the model and tokenizer through `from_pretrained`, with messages a user can act on when it fails.

The `tiny-random` alias is built first (engine.tiny_model) and then loaded through the very same path as a Hub
model. A model that cannot be found or downloaded raises `ModelLoadError` naming `--model-id PATH` and
`--model-id tiny-random`, never a bare traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from .backend import PER_REQUEST_ATTENTION, BackendChoice
from .config import EngineConfig
from .tiny_model import is_tiny_model, resolve_tiny_alias

logger = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says what to do instead."""


@dataclass(frozen=True)
class Checkpoint:
    """Where the model comes from and what its config declares, read before the backend is chosen."""

    source: str  # the folder or Hub id to load (the tiny-random alias resolved to its folder)
    hub_kwargs: dict  # revision, trust_remote_code, and local_files_only when the Hub is unreachable
    config: object  # the model's config, read once and handed to from_pretrained

    @property
    def dtype(self) -> str | None:
        """The dtype the checkpoint's config declares ("bfloat16", ...), None when it says nothing. Read it before
        `load_model`, which hands this config to the model (from then on it holds the dtype loaded)."""
        declared = getattr(self.config.get_text_config(), "dtype", None) or getattr(self.config, "dtype", None)
        return str(declared).removeprefix("torch.") if declared is not None else None


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    source: str  # the folder or Hub id actually loaded
    is_random: bool
    load_seconds: float


def _explain(model_id: str, error: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = "is not a local folder and could not be fetched from the Hugging Face Hub"
    if offline:
        where += " (HF_HUB_OFFLINE=1)"
    return (f"Could not load model {model_id!r}: it {where}.\n  Reason: {reason}\n"
            f"  Use a model folder on this machine with --model-id PATH, or the offline random model with "
            f"--model-id tiny-random.")


def hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    """Whether the Hub's name resolves within a few seconds (offline, huggingface_hub retries for ~45s)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    outcome: list[bool] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, 443)
            outcome.append(True)
        except OSError:
            outcome.append(False)

    worker = threading.Thread(target=resolve, daemon=True)  # getaddrinfo has no timeout of its own
    worker.start()
    worker.join(timeout_s)
    return bool(outcome and outcome[0])


def _looks_like_path(model_id: str) -> bool:
    """A Hub id is `name` or `owner/name`; anything else with slashes is meant as a folder."""
    return model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1


def inspect_checkpoint(config: EngineConfig) -> Checkpoint:
    """Resolve the model's source and read its config's dtype (only config.json is fetched; no weights)."""
    from transformers import AutoConfig

    source = resolve_tiny_alias(config.model_id)
    if not os.path.isdir(source) and _looks_like_path(source):
        raise ModelLoadError(f"Model folder not found: {source}. Give a folder that holds config.json and the "
                             "weights, a Hub id like 'Qwen/Qwen2.5-0.5B-Instruct', or --model-id tiny-random.")
    common = {"revision": config.revision, "trust_remote_code": config.trust_remote_code}
    if not os.path.isdir(source) and not hub_reachable():
        logger.warning("The Hugging Face Hub is unreachable: loading %s from the local cache only", source)
        common["local_files_only"] = True
    try:
        model_config = AutoConfig.from_pretrained(source, **common)
    except (OSError, ValueError) as error:
        raise ModelLoadError(_explain(config.model_id, error)) from error
    return Checkpoint(source=source, hub_kwargs=common, config=model_config)


def load_model(config: EngineConfig, backend: BackendChoice, checkpoint: Checkpoint) -> LoadedModel:
    """Load tokenizer and model on the chosen device and dtype. Raises ModelLoadError with advice on failure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    source, common = checkpoint.source, checkpoint.hub_kwargs
    # Load directly with the attention CB will use; our own path must be registered right before (engine.attention).
    attn = backend.attn_implementation
    if attn == PER_REQUEST_ATTENTION:
        from .attention import register_attention

        register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=checkpoint.config, dtype=getattr(torch, _DTYPES[backend.dtype]),
            device_map=backend.device, attn_implementation=attn, **common)
    except (OSError, ValueError) as error:
        if os.path.isdir(source) or "attn_implementation" in str(error) or "attention" in str(error).lower():
            raise ModelLoadError(f"Could not load model {config.model_id!r} with attention {attn!r}: {error}") from error
        raise ModelLoadError(_explain(config.model_id, error)) from error
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning("Model %s has no chat template: chat requests will be refused", config.model_id)
    model.eval()
    seconds = time.perf_counter() - start
    logger.info("Loaded %s in %.1fs (%s, %s)", source, seconds, backend.device, backend.dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, is_random=is_tiny_model(source),
                       load_seconds=seconds)

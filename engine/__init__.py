"""CB Studio's engine: one continuous-batching engine shared by the chat tab, the dataset tab and the CLI.

Importing this package does no work (no torch import); `Engine.start()` or `get_engine()` loads the model.
Map: config (settings), backend (device/dtype/attention choice), allocator (CPU malloc tuning), loader, tiny_model,
kv_cache (sizing), prompts, sampling, scheduler (chat first), attention (per-request, no flash) with paged_reads and
sparse_decode, text_stream, request, engine, stats, results, batch_job with datasets_io and checkpoint, cli.
"""

from .config import DEFAULT_MODEL_ID, EngineConfig, SamplingParams

__all__ = ["DEFAULT_MODEL_ID", "EngineConfig", "SamplingParams"]

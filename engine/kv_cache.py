"""Sizing the paged KV cache from a memory budget, the way transformers' CB accounts for it.

The budget (engine.backend) covers everything that grows with the number of cached tokens, as CB reserves it:
the keys and values of every layer, the copies read back at the attention peak (KV heads repeated to all heads
on the sdpa/eager paths), the read indices, and on those paths the [batch tokens x cache tokens] attention mask.
More cache than every in-flight request could fill at full context is not allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    page_size: int
    bytes_total: int  # what the cache and its cache-proportional tensors take
    bytes_per_token: int
    context_tokens: int  # the longest prompt + answer one request may have

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def shrunk(self, factor: float) -> CachePlan:
        blocks = max(2, int(self.num_blocks * factor))
        tokens = blocks * self.page_size
        return CachePlan(num_blocks=blocks, page_size=self.page_size, bytes_total=tokens * self.bytes_per_token,
                         bytes_per_token=self.bytes_per_token, context_tokens=min(self.context_tokens, tokens))


def attention_needs_mask(attn_implementation: str | None) -> bool:
    """Whether CB allocates and rebuilds every step its [batch tokens x cache tokens] mask for this implementation
    (mirrors transformers' `continuous_batching.utils.attn_mask_is_needed`; CB runs eager as paged|eager)."""
    name = "paged|eager" if attn_implementation == "eager" else attn_implementation
    return name in ("sdpa", "paged|eager")


def bytes_per_cache_token(text_config, itemsize: int, attention_has_mask: bool, flash_like: bool,
                          max_batch_tokens: int) -> int:
    """Bytes that each cached token costs in CB: cache, read-back peak, indices and (without flash) the mask."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    layers = text_config.num_hidden_layers
    kv_heads = find_num_key_value_heads(text_config)
    heads = text_config.num_attention_heads
    head_dim = find_head_dim(text_config)
    cache = layers * 2 * kv_heads * head_dim * itemsize
    heads_at_peak = 2 * kv_heads if flash_like else 2 * heads + kv_heads
    read_peak = heads_at_peak * head_dim * itemsize
    read_index = 8
    mask = max_batch_tokens * itemsize if attention_has_mask else 0
    return cache + read_peak + read_index + mask


def plan_kv_cache(text_config, itemsize: int, budget_bytes: int, page_size: int, max_batch_tokens: int,
                  attention_has_mask: bool, flash_like: bool, max_inflight: int) -> CachePlan:
    per_token = bytes_per_cache_token(text_config, itemsize, attention_has_mask, flash_like, max_batch_tokens)
    context = getattr(text_config, "max_position_embeddings", None) or 4096
    useful_tokens = context * max(max_inflight, 16)
    tokens = min(budget_bytes // per_token, useful_tokens)
    blocks = max(2, tokens // page_size)
    tokens = blocks * page_size
    return CachePlan(num_blocks=blocks, page_size=page_size, bytes_total=tokens * per_token,
                     bytes_per_token=per_token, context_tokens=min(context, tokens))

"""Paged reads: the per-request attention reads keys and values from CB's paged cache itself, not from a copy.

At every layer of every step, CB's `PagedAttentionCache.update` (its index-based path, which every attention
without the flash decode fast path takes) writes the step's new keys and values into the paged cache, then gathers
every key and value of every request in the step into one contiguous [keys, kv_heads, dim] copy (`index_select`
with the step's `read_index`). engine.attention then copies the decode rows' keys a second time, into its padded
layout. On 2 CPU cores that first copy was 14% of the generation loop (cProfile of `bench.throughput`'s workload).

`install_paged_reads(cache)` wraps one cache's `update`: for full-attention layers it lets CB write the new keys
and values (CB's own code, handed an empty read index so it reads nothing back) and returns the layer's whole cache
view instead of the copy, with the step's read index under `PAGED_READ_KWARG` in the layer's kwargs: the dict that
transformers' models pass on to the attention function. engine.attention then gathers each request's keys straight
from the cache, once. Attention without that kwarg (any other layer, any other caller) is unchanged.

Left to CB's own read: sliding-window layers (their allocator reads before it writes, as new keys may overwrite
old ones in the window), the block-table path (flash decode), and steps with nothing cached (CB skips the read).
Written against transformers 5.24's `PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)` and
`FullAttentionCacheAllocator._kv_token_views`; `install_paged_reads` checks both and leaves the cache as it is
(logging why) when they are not there.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

PAGED_READ_KWARG = "cbs_paged_read_index"
"""The kwarg that carries a layer's read index ([keys] positions in the cache view) to engine.attention."""


def install_paged_reads(cache) -> bool:
    """Make this `PagedAttentionCache` hand full-attention layers the cache itself. Returns whether it did."""
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

    layer_allocators = getattr(cache, "layer_to_allocator", None)
    parameters = list(inspect.signature(cache.update).parameters)
    if layer_allocators is None or parameters[:4] != ["key_states", "value_states", "layer_idx", "kwargs"]:
        logger.warning("Paged reads not installed: this transformers' PagedAttentionCache.update is not the one "
                       "engine.paged_reads was written for; attention reads CB's gathered copy instead")
        return False
    full = [allocator for allocator in layer_allocators.values() if allocator.layer_type == FULL_ATTENTION]
    if not all(hasattr(allocator, "_kv_token_views") for allocator in full):
        logger.warning("Paged reads not installed: the full-attention cache allocator has no token views")
        return False
    cb_update = cache.update

    def update(key_states, value_states, layer_idx, kwargs):
        allocator = layer_allocators[layer_idx]
        read_indices = kwargs.get("read_index")
        if allocator.layer_type != FULL_ATTENTION or kwargs.get("block_table") is not None or read_indices is None:
            return cb_update(key_states, value_states, layer_idx, kwargs)
        read_index = read_indices[allocator.index]
        if read_index.numel() == 0:  # nothing cached in this step: CB returns the new keys without a copy
            return cb_update(key_states, value_states, layer_idx, kwargs)
        write_only = list(read_indices)
        write_only[allocator.index] = read_index[:0]
        kwargs["read_index"] = write_only
        cb_update(key_states, value_states, layer_idx, kwargs)  # writes; with nothing to read it copies nothing
        kwargs["read_index"] = read_indices
        kwargs[PAGED_READ_KWARG] = read_index
        k_cache, v_cache = allocator._kv_token_views[layer_idx]  # [cache tokens, kv_heads, dim]
        return k_cache.transpose(0, 1).unsqueeze(0), v_cache.transpose(0, 1).unsqueeze(0)

    cache.update = update
    return True

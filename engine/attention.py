"""Per-request ("varlen") attention for transformers' continuous batching (CB) when no flash attention is installed.

Why
---
Without flash attention, CB runs each layer's attention as ONE `sdpa` call over the whole batch: every query token
against every cached key of every request, with a block-diagonal float mask of shape [1, 1, batch tokens, keys]
that CB allocates up front and rebuilds (in Python, request by request) at every step, and with the key/value heads
repeated (`repeat_kv`) first. The cost grows with the square of the batch. `varlen_attention_forward` computes each
request's attention over its own keys only, from the `cu_seq_lens_q` / `cu_seq_lens_k` that CB passes to every
attention function:

- decoding rows (one query token) are batched into ONE padded `scaled_dot_product_attention` call: their keys are
  gathered into a [rows, kv_heads, longest, dim] tensor with a key-padding mask, and grouped-query attention is left
  to sdpa (`enable_gqa=True`), without `repeat_kv`. When key lengths are very uneven (say one long conversation
  among many short ones) the rows are split into a few length groups, one call each, so padding stays under 2x.
  When the keys arrive as CB's gathered copy (no paged reads, see below) and that padded copy would be large, the
  decode rows go through engine.sparse_decode instead, which reads the copy in place;
- prefill and chunked-prefill rows (several query tokens) get one sdpa call each over their own keys (cached prefix
  + new tokens), causal with the diagonal aligned bottom-right when there are more keys than queries.

With engine.paged_reads installed on CB's cache, full-attention layers receive the paged cache itself and the
step's read index (`PAGED_READ_KWARG`) instead of CB's gathered copy of the step's keys: the padded decode copy and
each prefill row's keys are then gathered straight from the cache, and decode rows always take the padded call.
Measured on 2 cores (64-dim heads, 4 query / 2 KV heads; 16 to 128 decode rows of 50 to 2,000 keys): from the
cache 1.0-67 ms per layer, against 1.6-86 ms for CB's copy then the sparse product and 1.2-122 ms for CB's copy
then the padded call (figures per size in engine.sparse_decode).

The per-step bookkeeping (Python lists of lengths, gather indices, masks) is computed once per forward step and
reused by every layer. Outside CB (no `cu_seq_lens_*` kwargs: `model.generate`, a plain forward) the call goes to
transformers' stock `sdpa_attention_forward`, so the same loaded model still works with `generate`.

The registered name, and what CB does because of it (transformers 5.24)
-------------------------------------------------------------------------
`register_attention()` registers the function under `ATTENTION_NAME` = "cbs_varlen_noflash". CB decides several
things from the name alone:

1. Accepted at all: `ContinuousBatchingManager.switch_to_cb_friendly_attn` only accepts "sdpa", "paged|eager" or a
   name containing "flash" (`utils.generic.is_flash_attention_requested`). A name without "flash" (say
   "cbs_varlen") is rejected with "Implementation ... is not supported for continuous batching". Hence "flash" in
   the name, although no flash kernel is involved ("noflash").
2. No attention mask: `continuous_batching.utils.attn_mask_is_needed` is True only for "sdpa" and "paged|eager".
   For our name CB neither allocates the [max_batch_tokens, cache tokens + max_batch_tokens] mask buffer nor
   rebuilds it each step; it passes `attention_mask=None`, `is_causal=True` (ignored here). `masking_utils` also
   returns no mask under CB (the cache is a `PagedAttentionCache`). See `engine.kv_cache.attention_needs_mask`.
3. Memory planning: `PagedAttentionMemoryHandler` (used when `num_blocks` is not given) budgets no mask and
   GQA-native key/value reads (kv heads, not repeated heads) for "flash" names, which is what this function does.
   It does not know about the transient padded key/value copy of the decode rows (see "Memory" below).
4. No auto-switch: "flash" names are kept as is (`auto_switch_to_flash` only replaces sdpa/eager).
5. Decode fast path (`max_blocks_per_request`, `flash_attn_with_kvcache` with a block table) is only considered for
   names matching `.*flash.*2` / `.*flash.*3` on CUDA (or `.*flash.*2` on XPU). Our name has no digit, so the fast
   path is always off (`max_blocks_per_request` resolved to 0): every step uses the index-based cache update that
   hands us the keys/values, and no block-table kwargs.
6. Compile: with `default_compile_level > 0`, "flash" names get no varlen compile config (like flash varlen). Our
   CB branch is also wrapped in `torch.compiler.disable`.
7. CUDA graphs and async batching: with no mask needed, CB's *default* on CUDA/XPU is `use_cuda_graph=(True, True)`
   and then async batching. This function reads the sequence lengths on the host (`.tolist()`) and its shapes depend
   on them, so it cannot be captured in a graph: on an accelerator pass
   `ContinuousBatchingConfig(use_cuda_graph=False)` (async batching then defaults to off). On CPU there is no graph
   backend and nothing to do. The function raises a clear error if it finds itself inside a graph capture.

Loading with the name: `from_pretrained(attn_implementation=NAME)` / `set_attn_implementation(NAME)` check the name
(`PreTrainedModel._check_and_adjust_attn_implementation`): it must be registered in `AttentionInterface` (done
here), it is not a hub kernel (no "/", so `is_kernel` is False and nothing is downloaded), and because it contains
"flash" transformers "preloads" it with `lazy_import_flash_attention(NAME)`, which would fail ("Could not find the
currently requested flash attention implementation") since no such kernel exists. That loader skips the import
when its module-global `_loaded_implementation` already equals the requested name, so `register_attention()` sets
it to our name. Call `register_attention()` right before each `from_pretrained` / `set_attn_implementation` with
the name (it is idempotent and cheap): loading a real flash implementation in between would reset that global.
The name is also registered in `AttentionMaskInterface` with sdpa's mask function, so `generate` builds the same
masks as with "sdpa" (CB builds none).

Memory: beyond what CB budgets, a step holds transiently, per layer, the decode rows' keys and values padded within
their length group (at most about 2x the keys those rows read, which CB already budgets once; capped at 16 MiB on
CPU in float32, where larger batches take the sparse path, whose scores take query heads x decode keys floats) and
one [q, k] boolean mask per chunked-prefill row. That is far below the block-diagonal mask the stock path keeps
(max_batch_tokens x cache tokens, model dtype) and its [heads, batch tokens, keys] scores.

Unsupported under CB: attention sinks (`s_aux`), `softcap`, `position_bias`, `output_attentions` (none of them is
used by Llama/Qwen2-like models); they raise instead of computing something else.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import sparse_decode
from .backend import PER_REQUEST_ATTENTION as ATTENTION_NAME  # the name lives where the backend choice is made
from .paged_reads import PAGED_READ_KWARG

CB_CONFIG_OVERRIDES = {"use_cuda_graph": False}
"""`ContinuousBatchingConfig` settings CB needs with `ATTENTION_NAME`. On CUDA/XPU CB would default to graphs (and
async batching) for a name without mask, and this attention cannot be captured; on CPU the setting changes nothing."""

_register_lock = threading.Lock()



def register_attention() -> str:
    """Register the per-request attention with transformers and return the `attn_implementation` name to use.

    Idempotent; call it before every `from_pretrained(attn_implementation=NAME)` / `set_attn_implementation(NAME)`
    (see the module docstring for why the flash loader's global is set here).
    """
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    with _register_lock:
        if ALL_ATTENTION_FUNCTIONS.get(ATTENTION_NAME) is not varlen_attention_forward:
            AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
        if ALL_MASK_ATTENTION_FUNCTIONS.get(ATTENTION_NAME) is not sdpa_mask:
            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        # transformers "preloads" any name containing "flash" as a flash kernel when a model is loaded or switched;
        # the loader does nothing when this global already names the implementation (there is no kernel to load).
        flash_utils._loaded_implementation = ATTENTION_NAME
    return ATTENTION_NAME


# ------------------------------------------------------------------------------------------------ the per-step plan --


@dataclass
class _PrefillRow:
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    mask: torch.Tensor | None  # [q_len, k_len] bool (True = attend), None = plain causal (is_causal=True)


@dataclass
class _DecodeGroup:
    """Decode rows (one query token each) served by one padded sdpa call."""

    rows: int
    longest: int
    q_index: torch.Tensor | None  # [rows] query positions; None when they are 0..rows-1
    k_index: torch.Tensor  # [rows * longest] key positions, padded with the row's first key
    mask: torch.Tensor  # [rows, 1, 1, longest] bool, True = attend
    _cache_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (read index, k_index mapped through it)

    def cache_index(self, read_index: torch.Tensor) -> torch.Tensor:
        """k_index as positions in the paged cache. Every full-attention layer of a step passes the same read index,
        so this is composed once per step, not once per layer."""
        if self._cache_index is None or self._cache_index[0] is not read_index:
            self._cache_index = (read_index, read_index.index_select(0, self.k_index))
        return self._cache_index[1]


@dataclass
class _DecodeRows:
    """The decode rows of a step; their gather indices / sparsity pattern are built on first use (per layout)."""

    q_pos: list[int]
    k_starts: list[int]  # first key each row attends (sliding window applied)
    k_lens: list[int]  # keys each row attends
    q_index: torch.Tensor | None  # [rows] query positions of all decode rows; None when they are 0..rows-1
    device: torch.device
    _groups: list[_DecodeGroup] | None = None
    _sparse: dict[tuple[int, int], sparse_decode.SparseLayout] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.q_pos)

    def groups(self) -> list[_DecodeGroup]:
        if self._groups is None:
            self._groups = [
                _decode_group([self.q_pos[r] for r in group], [self.k_starts[r] for r in group],
                              [self.k_lens[r] for r in group], self.device)
                for group in _group_decode_rows(self.k_lens)
            ]
        return self._groups

    def padded_slots(self) -> int:
        return sum(group.rows * group.longest for group in self.groups())

    def sparse(self, kv_heads: int, groups: int) -> sparse_decode.SparseLayout:
        if (kv_heads, groups) not in self._sparse:
            self._sparse[kv_heads, groups] = sparse_decode.build_layout(self.k_starts, self.k_lens, kv_heads, groups,
                                                                        self.device)
        return self._sparse[kv_heads, groups]



@dataclass
class _Plan:
    """Everything about one forward step's batch layout that does not depend on the layer."""

    total_q: int
    total_k: int
    covered_q: int  # query rows that belong to a request; the rest is padding
    decode: _DecodeRows | None = None
    prefill: list[_PrefillRow] = field(default_factory=list)


# Padded decode: rows are padded to the longest key length of their group. Rows are split into groups (longest
# first) when a row has at most half the keys of its group's longest and the split saves at least this many padded
# key slots: the padding then stays under 2x the real keys (memory and work), for one more sdpa call per group.
_MIN_SPLIT_SAVING = 2048


def _row_mask(q_len: int, k_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal mask aligned bottom-right (query j sits at key position k_len - q_len + j), plus sliding window."""
    offset = k_len - q_len
    if offset == 0 and not sliding_window:
        return None
    delta = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
    mask = delta <= offset
    if sliding_window:
        mask &= delta > offset - sliding_window
    return mask


def _group_decode_rows(k_lens: list[int]) -> list[list[int]]:
    """Split decode rows (indices into k_lens) into groups of similar key length; rows keep their order in a group."""
    order = sorted(range(len(k_lens)), key=lambda row: -k_lens[row])
    groups, current, longest = [], [order[0]], k_lens[order[0]]
    for position in range(1, len(order)):
        row = order[position]
        length = k_lens[row]
        if 2 * length <= longest and (len(order) - position) * (longest - length) >= _MIN_SPLIT_SAVING:
            groups.append(current)
            current, longest = [], length
        current.append(row)
    groups.append(current)
    return [sorted(group) for group in groups]


def _decode_group(q_pos: list[int], k_starts: list[int], k_lens: list[int], device: torch.device) -> _DecodeGroup:
    rows, longest = len(q_pos), max(k_lens)
    q_index = None if q_pos == list(range(rows)) else torch.tensor(q_pos, dtype=torch.long, device=device)
    starts = torch.tensor(k_starts, dtype=torch.long, device=device)
    lengths = torch.tensor(k_lens, dtype=torch.long, device=device)
    positions = torch.arange(longest, device=device)
    valid = positions[None, :] < lengths[:, None]  # [rows, longest]
    k_index = (starts[:, None] + torch.where(valid, positions[None, :], 0)).reshape(-1)
    return _DecodeGroup(rows=rows, longest=longest, q_index=q_index, k_index=k_index, mask=valid[:, None, None, :])


def _build_plan(
    cu_q: list[int], cu_k: list[int], total_q: int, total_k: int, sliding_window: int | None, device: torch.device
) -> _Plan:
    plan = _Plan(total_q=total_q, total_k=total_k, covered_q=cu_q[-1] - cu_q[0])
    decode_q: list[int] = []
    decode_k_start: list[int] = []
    decode_k_len: list[int] = []
    for i in range(len(cu_q) - 1):
        q_start, q_len = cu_q[i], cu_q[i + 1] - cu_q[i]
        k_start, k_len = cu_k[i], cu_k[i + 1] - cu_k[i]
        if q_len == 0:  # padding sequence (CUDA graphs / compile pad the batch with empty sequences)
            continue
        if k_len < q_len or q_start + q_len > total_q or k_start + k_len > total_k:
            raise ValueError(f"Request {i}: {q_len} queries at {q_start}, {k_len} keys at {k_start} do not fit a "
                             f"CB batch of {total_q} queries and {total_k} keys")
        if q_len == 1:
            # The single query sits at key position k_len - 1: a sliding window keeps the last `window` keys
            skipped = k_len - sliding_window if sliding_window and k_len > sliding_window else 0
            decode_q.append(q_start)
            decode_k_start.append(k_start + skipped)
            decode_k_len.append(k_len - skipped)
        else:
            mask = _row_mask(q_len, k_len, sliding_window, device)
            plan.prefill.append(_PrefillRow(q_start, q_len, k_start, k_len, mask))
    if decode_q:
        rows = len(decode_q)
        q_index = None if decode_q == list(range(rows)) else torch.tensor(decode_q, dtype=torch.long, device=device)
        plan.decode = _DecodeRows(decode_q, decode_k_start, decode_k_len, q_index, device)
    return plan


class _PlanCache(threading.local):
    """The plan of the current step, per thread. Keyed on the very `cu_seq_lens` tensors CB passes to every layer of a
    step (checked alive through weak references, so a recycled `id` never matches; CB makes new views of its static
    buffers at every step) and on a fingerprint of their content: the version counter (bumped by any in-place write,
    shared with every view of the buffer), or, for inference-mode tensors which have none, the values themselves
    on CPU (cheap) and nothing more than identity on an accelerator (reading them would synchronize every layer)."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []


_plans = _PlanCache()


def _fingerprint(tensor: torch.Tensor):
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return tuple(tensor.tolist()) if tensor.device.type == "cpu" else None


def _get_plan(
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    sliding_window: int | None,
    device: torch.device,
) -> _Plan:
    key = (_fingerprint(cu_seq_lens_q), _fingerprint(cu_seq_lens_k), total_q, total_k, sliding_window)
    for ref_q, ref_k, entry_key, plan in _plans.entries:
        if ref_q() is cu_seq_lens_q and ref_k() is cu_seq_lens_k and entry_key == key:
            return plan
    plan = _build_plan(cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist(), total_q, total_k, sliding_window, device)
    # A few entries: hybrid models alternate full and sliding layers (two cu_seq_lens_k, two windows) in one step
    _plans.entries = [(weakref.ref(cu_seq_lens_q), weakref.ref(cu_seq_lens_k), key, plan), *_plans.entries[:3]]
    return plan


def clear_plan_cache() -> None:
    """Forget the cached step plans of this thread (tests; never needed for correctness)."""
    _plans.entries = []


# -------------------------------------------------------------------------------------------------- the attention --


def _layer_cu_seq_lens_k(module: torch.nn.Module, cu_seq_lens_k):
    """CB's `cache.update` turns the per-layer-type dict into this layer's tensor; without it, pick the right one."""
    if not isinstance(cu_seq_lens_k, dict):
        return cu_seq_lens_k
    if len(cu_seq_lens_k) == 1:
        return next(iter(cu_seq_lens_k.values()))
    layer_type = getattr(module, "layer_type", None) or "full_attention"
    return cu_seq_lens_k[layer_type]


def _padded_decode(group: _DecodeGroup, q_tokens: torch.Tensor, k_tokens: torch.Tensor, v_tokens: torch.Tensor,
                   scaling: float | None, dropout: float, read_index: torch.Tensor | None) -> torch.Tensor:
    """One sdpa call for a group of decode rows, keys and values copied into a padded [rows, kv_heads, longest, dim]
    layout with a key-padding mask; GQA is left to sdpa. With a `read_index`, k/v_tokens are the paged cache and
    the copy reads it directly (engine.paged_reads). Returns [rows, heads, dim]."""
    rows, longest = group.rows, group.longest
    q_rows = q_tokens[:rows] if group.q_index is None else q_tokens.index_select(0, group.q_index)
    k_index = group.k_index if read_index is None else group.cache_index(read_index)
    k_rows = k_tokens.index_select(0, k_index).view(rows, longest, k_tokens.shape[1], k_tokens.shape[2])
    v_rows = v_tokens.index_select(0, k_index).view(rows, longest, v_tokens.shape[1], v_tokens.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(
        q_rows.unsqueeze(2),  # [rows, heads, 1, dim]
        k_rows.transpose(1, 2),  # [rows, kv_heads, longest, dim]
        v_rows.transpose(1, 2),
        attn_mask=group.mask,  # [rows, 1, 1, longest]
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=q_tokens.shape[1] != k_tokens.shape[1],
    ).squeeze(2)


@torch.compiler.disable
def _varlen_attention(
    query: torch.Tensor,  # [1, heads, total_q, dim]
    key: torch.Tensor,  # [1, kv_heads, total_k, dim]
    value: torch.Tensor,  # [1, kv_heads, total_k, dim]
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    read_index: torch.Tensor | None = None,  # [total_k] positions of the step's keys in key/value (paged reads)
) -> torch.Tensor:  # [1, total_q, heads, dim]
    if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"The {ATTENTION_NAME!r} attention reads sequence lengths on the host and cannot be captured in a CUDA "
            "graph: pass ContinuousBatchingConfig(use_cuda_graph=False)."
        )
    if query.shape[0] != 1:
        raise ValueError(f"Continuous batching packs the batch in one row; got query of shape {tuple(query.shape)}")
    _, heads, total_q, _ = query.shape
    # key/value: the step's keys in order, or with a read index the whole paged cache (engine.paged_reads)
    total_k = key.shape[2] if read_index is None else read_index.numel()
    sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
    plan = _get_plan(cu_seq_lens_q, cu_seq_lens_k, total_q, total_k, sliding_window, query.device)
    enable_gqa = key.shape[1] != heads  # prefill rows; decode rows decide in their helpers

    # Token-major views: CB hands q/k/v as transposes of [tokens, heads, dim] buffers, so these are free.
    q_tokens = query[0].transpose(0, 1)  # [total_q, heads, dim]
    k_tokens = key[0].transpose(0, 1)  # [total_k, kv_heads, dim]
    v_tokens = value[0].transpose(0, 1)

    # Decode rows: (query positions or None for 0..rows-1, rows, output [rows, heads, dim]) per call
    decode_outputs: list[tuple[torch.Tensor | None, int, torch.Tensor]] = []
    decode = plan.decode
    if decode is not None:
        # Reading the paged cache directly (read_index), the padded call was faster at every size measured.
        if read_index is None and decode.rows > 1 and not dropout and sparse_decode.pays_off(
                query, key, value, decode.padded_slots()):
            q_rows = q_tokens[: decode.rows] if decode.q_index is None else q_tokens.index_select(0, decode.q_index)
            layout = decode.sparse(key.shape[1], heads // key.shape[1])
            decode_outputs.append((decode.q_index, decode.rows,
                                   sparse_decode.decode(layout, q_rows, k_tokens, v_tokens, scaling)))
        else:
            for group in decode.groups():
                decode_outputs.append((group.q_index, group.rows, _padded_decode(
                    group, q_tokens, k_tokens, v_tokens, scaling, dropout, read_index)))
        if len(decode_outputs) == 1 and not plan.prefill and decode_outputs[0][0] is None and decode.rows == total_q:
            return decode_outputs[0][2].unsqueeze(0)  # decode only: the rows are the output, in order

    out_dim = value.shape[-1]
    out = query.new_zeros(total_q, heads, out_dim) if plan.covered_q < total_q else query.new_empty(
        total_q, heads, out_dim)
    for q_index, rows, rows_out in decode_outputs:
        if q_index is None:
            out[:rows] = rows_out
        else:
            out.index_copy_(0, q_index, rows_out)
    for row in plan.prefill:
        q_row = query[:, :, row.q_start : row.q_start + row.q_len]
        if read_index is None:
            k_row = key[:, :, row.k_start : row.k_start + row.k_len]
            v_row = value[:, :, row.k_start : row.k_start + row.k_len]
        else:  # this row's keys, gathered from the paged cache: [1, kv_heads, k_len, dim]
            positions = read_index[row.k_start : row.k_start + row.k_len]
            k_row = k_tokens.index_select(0, positions).transpose(0, 1).unsqueeze(0)
            v_row = v_tokens.index_select(0, positions).transpose(0, 1).unsqueeze(0)
        row_out = torch.nn.functional.scaled_dot_product_attention(
            q_row,
            k_row,
            v_row,
            attn_mask=row.mask,
            dropout_p=dropout,
            is_causal=row.mask is None,
            scale=scaling,
            enable_gqa=enable_gqa,
        )  # [1, heads, q_len, dim]
        out[row.q_start : row.q_start + row.q_len] = row_out[0].transpose(0, 1)
    return out.unsqueeze(0)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: per-request attention under CB, stock sdpa anywhere else.

    Returns `(attn_output [1, total_q, heads, dim], None)`, the layout of transformers' `sdpa_attention_forward`.
    """
    cu_seq_lens_q = kwargs.get("cu_seq_lens_q")
    cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            sliding_window=sliding_window, **kwargs,
        )
    for unsupported in ("s_aux", "softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"The {ATTENTION_NAME!r} attention does not support `{unsupported}`")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"The {ATTENTION_NAME!r} attention cannot return attention weights")
    attn_output = _varlen_attention(
        query, key, value, cu_seq_lens_q, _layer_cu_seq_lens_k(module, cu_seq_lens_k), scaling, dropout,
        sliding_window, kwargs.get(PAGED_READ_KWARG),
    )
    return attn_output, None

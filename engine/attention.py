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
  to sdpa (`enable_gqa=True`), without `repeat_kv`;
- prefill and chunked-prefill rows (several query tokens) get one sdpa call each over their own keys (cached prefix
  + new tokens), causal with the diagonal aligned bottom-right when there are more keys than queries.

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
   returns no mask under CB (the cache is a `PagedAttentionCache`). See `cb_allocates_attention_mask`.
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

Memory: beyond what CB budgets, a step holds transiently, per layer, the decode rows' keys and values padded to the
longest decode row (2 x rows x longest x kv_heads x head_dim elements) and one [q, k] boolean mask per chunked-prefill
row. That is far below the block-diagonal mask the stock path keeps (max_batch_tokens x cache tokens, model dtype).

Unsupported under CB: attention sinks (`s_aux`), `softcap`, `position_bias`, `output_attentions` (none of them is
used by Llama/Qwen2-like models); they raise instead of computing something else.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

ATTENTION_NAME = "cbs_varlen_noflash"
"""The name to pass as `attn_implementation` once `register_attention()` has run."""

# transformers' continuous_batching.utils.attn_mask_is_needed: only these names get the big block-diagonal mask.
_CB_MASKED_IMPLEMENTATIONS = ("sdpa", "paged|eager")

ALLOCATES_ATTENTION_MASK = False
"""Whether CB allocates (and budgets, and rebuilds every step) its attention mask for `ATTENTION_NAME`: it does not."""

_register_lock = threading.Lock()


def cb_allocates_attention_mask(attn_implementation: str | None) -> bool:
    """Whether transformers' CB allocates its [max_batch_tokens, cache tokens + max_batch_tokens] attention mask for
    this implementation name (mirrors `continuous_batching.utils.attn_mask_is_needed`; eager is run as paged|eager).
    The engine should budget KV memory for the mask only when this is True."""
    name = "paged|eager" if attn_implementation == "eager" else attn_implementation
    return name in _CB_MASKED_IMPLEMENTATIONS


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
class _Plan:
    """Everything about one forward step's batch layout that does not depend on the layer."""

    total_q: int
    total_k: int
    covered_q: int  # query rows that belong to a request; the rest is padding
    # Decode rows (query length 1), batched in one padded call
    num_decode: int = 0
    decode_q_index: torch.Tensor | None = None  # [n] query positions; None when they are 0..n-1
    decode_k_index: torch.Tensor | None = None  # [n * longest] key positions, padded with 0
    decode_mask: torch.Tensor | None = None  # [n, 1, 1, longest] bool, True = attend
    decode_longest: int = 0
    prefill: list[_PrefillRow] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return self.num_decode == self.total_q and self.decode_q_index is None and not self.prefill


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


def _build_plan(
    cu_q: list[int], cu_k: list[int], total_q: int, total_k: int, sliding_window: int | None, device: torch.device
) -> _Plan:
    plan = _Plan(total_q=total_q, total_k=total_k, covered_q=cu_q[-1])
    decode_q: list[int] = []
    decode_k_start: list[int] = []
    decode_k_len: list[int] = []
    for i in range(len(cu_q) - 1):
        q_start, q_len = cu_q[i], cu_q[i + 1] - cu_q[i]
        k_start, k_len = cu_k[i], cu_k[i + 1] - cu_k[i]
        if q_len == 0:  # padding sequence (CUDA graphs / compile pad the batch with empty sequences)
            continue
        if k_len < q_len:
            raise ValueError(f"Request {i} has {q_len} query tokens but only {k_len} keys: not a CB batch layout")
        if q_len == 1:
            decode_q.append(q_start)
            decode_k_start.append(k_start)
            decode_k_len.append(k_len)
        else:
            mask = _row_mask(q_len, k_len, sliding_window, device)
            plan.prefill.append(_PrefillRow(q_start, q_len, k_start, k_len, mask))

    n = len(decode_q)
    if n:
        plan.num_decode = n
        longest = max(decode_k_len)
        plan.decode_longest = longest
        if decode_q != list(range(n)):
            plan.decode_q_index = torch.tensor(decode_q, dtype=torch.long, device=device)
        starts = torch.tensor(decode_k_start, dtype=torch.long, device=device)
        lengths = torch.tensor(decode_k_len, dtype=torch.long, device=device)
        positions = torch.arange(longest, device=device)
        valid = positions[None, :] < lengths[:, None]  # [n, longest]
        if sliding_window:  # the single query sits at key position k_len - 1
            valid &= positions[None, :] > lengths[:, None] - 1 - sliding_window
        plan.decode_k_index = torch.where(valid, starts[:, None] + positions[None, :], 0).reshape(-1)
        plan.decode_mask = valid[:, None, None, :]
    return plan


class _PlanCache(threading.local):
    """The plan of the current step, per thread. Keyed on the very `cu_seq_lens` tensors CB passes to every layer of a
    step (checked alive through weak references, so a recycled `id` never matches) and on their version counter (CB
    writes the lengths in place into a static buffer, which bumps the counter shared with every view of it)."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []


_plans = _PlanCache()


def _get_plan(
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    sliding_window: int | None,
    device: torch.device,
) -> _Plan:
    versions = (cu_seq_lens_q._version, cu_seq_lens_k._version, total_q, total_k, sliding_window)
    for ref_q, ref_k, key, plan in _plans.entries:
        if ref_q() is cu_seq_lens_q and ref_k() is cu_seq_lens_k and key == versions:
            return plan
    plan = _build_plan(cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist(), total_q, total_k, sliding_window, device)
    # A few entries: hybrid models alternate full and sliding layers (two cu_seq_lens_k, two windows) in one step
    _plans.entries = [(weakref.ref(cu_seq_lens_q), weakref.ref(cu_seq_lens_k), versions, plan), *_plans.entries[:3]]
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
) -> torch.Tensor:  # [1, total_q, heads, dim]
    if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"The {ATTENTION_NAME!r} attention reads sequence lengths on the host and cannot be captured in a CUDA "
            "graph: pass ContinuousBatchingConfig(use_cuda_graph=False)."
        )
    if query.shape[0] != 1:
        raise ValueError(f"Continuous batching packs the batch in one row; got query of shape {tuple(query.shape)}")
    _, heads, total_q, dim = query.shape
    total_k = key.shape[2]
    sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
    plan = _get_plan(cu_seq_lens_q, cu_seq_lens_k, total_q, total_k, sliding_window, query.device)
    enable_gqa = key.shape[1] != heads

    # Token-major views: CB hands q/k/v as transposes of [tokens, heads, dim] buffers, so these are free.
    q_tokens = query[0].transpose(0, 1)  # [total_q, heads, dim]
    k_tokens = key[0].transpose(0, 1)  # [total_k, kv_heads, dim]
    v_tokens = value[0].transpose(0, 1)

    decode_out = None
    if plan.num_decode:
        n, longest = plan.num_decode, plan.decode_longest
        q_rows = q_tokens[:n] if plan.decode_q_index is None else q_tokens.index_select(0, plan.decode_q_index)
        k_rows = k_tokens.index_select(0, plan.decode_k_index).view(n, longest, -1, dim).transpose(1, 2)
        v_rows = v_tokens.index_select(0, plan.decode_k_index).view(n, longest, -1, v_tokens.shape[-1]).transpose(1, 2)
        decode_out = torch.nn.functional.scaled_dot_product_attention(
            q_rows.unsqueeze(2),  # [n, heads, 1, dim]
            k_rows,  # [n, kv_heads, longest, dim]
            v_rows,
            attn_mask=plan.decode_mask,  # [n, 1, 1, longest]
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=enable_gqa,
        ).squeeze(2)  # [n, heads, dim]
        if plan.decode_only:
            return decode_out.unsqueeze(0)

    out_dim = value.shape[-1]
    if plan.covered_q < total_q or plan.num_decode + sum(r.q_len for r in plan.prefill) < total_q:
        out = query.new_zeros(total_q, heads, out_dim)
    else:
        out = query.new_empty(total_q, heads, out_dim)
    if decode_out is not None:
        if plan.decode_q_index is None:
            out[: plan.num_decode] = decode_out
        else:
            out.index_copy_(0, plan.decode_q_index, decode_out)
    for row in plan.prefill:
        q_row = query[:, :, row.q_start : row.q_start + row.q_len]
        k_row = key[:, :, row.k_start : row.k_start + row.k_len]
        v_row = value[:, :, row.k_start : row.k_start + row.k_len]
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
        sliding_window,
    )
    return attn_output, None

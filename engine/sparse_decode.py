"""Block-sparse decode attention on CPU: every decode row against its own keys, read in place from one key tensor.

engine.attention normally copies each decode row's keys and values into a padded [rows, kv_heads, longest, dim]
layout for one sdpa call. When the keys arrive as CB's gathered copy (no engine.paged_reads: sliding-window layers,
or a transformers whose cache paged_reads does not know) and that padded copy would be large, this computes the
same thing without a second copy: `torch.sparse.sampled_addmm` for the scores of each row against its own keys
only, a per-row softmax (`segment_reduce`), and `torch.sparse.mm` with the values, one CSR product per KV head.

Measured on 2 CPU cores with CB's copy as input (64-dim heads, 4 query / 2 KV heads): against the padded call,
1.6 vs 1.2 ms per layer for 16 rows of 50-300 keys, 5.2 vs 5.3 ms for 64 x 100-400, 13.8 vs 15.8 ms for
64 x 300-1200 and 86 vs 122 ms for 128 x 500-2000. Hence `pays_off`: CPU, float32/64, and a padded copy of at
least 16 MiB. Reading the paged cache directly with the padded call beat both at every one of those sizes.
This module knows nothing about CB; engine.attention decides when to call it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# torch says this once per process when the first CSR tensor is built; the CSR ops used here are stable enough.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state", category=UserWarning)

SPARSE_MIN_BYTES = 16 << 20
"""The size of the padded key and value copy from which the sparse product is used instead (CPU, float32/64)."""


@dataclass
class SparseLayout:
    """All decode rows as one block-sparse pattern: row (request i, query head g of a KV head) x its own keys."""

    crow: torch.Tensor  # [kv_heads, rows * groups + 1] CSR row offsets
    col: torch.Tensor  # [kv_heads, nnz] key positions
    row_ids: torch.Tensor  # [nnz] CSR row of each stored score
    lengths: torch.Tensor  # [rows * groups] keys per CSR row
    zeros: torch.Tensor  # [kv_heads, nnz] placeholder values of the sampling pattern


def pays_off(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padded_slots: int) -> bool:
    """Whether the sparse product beats copying `padded_slots` keys and values per KV head into a padded layout."""
    padded_bytes = padded_slots * key.shape[1] * (key.shape[-1] + value.shape[-1]) * key.element_size()
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and padded_bytes >= SPARSE_MIN_BYTES)


def build_layout(k_starts: list[int], k_lens: list[int], kv_heads: int, groups: int,
                 device: torch.device) -> SparseLayout:
    """The pattern for decode rows whose keys are k_lens[i] consecutive positions from k_starts[i]."""
    lengths = torch.tensor(k_lens, dtype=torch.long, device=device).repeat_interleave(groups)
    starts = torch.tensor(k_starts, dtype=torch.long, device=device).repeat_interleave(groups)
    crow = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=device)
    torch.cumsum(lengths, 0, out=crow[1:])
    nnz = int(crow[-1])
    row_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=nnz)
    col = starts.index_select(0, row_ids) + torch.arange(nnz, device=device) - crow.index_select(0, row_ids)
    return SparseLayout(crow=crow.expand(kv_heads, -1).contiguous(), col=col.expand(kv_heads, -1).contiguous(),
                        row_ids=row_ids, lengths=lengths, zeros=torch.zeros(kv_heads, nnz, device=device))


def decode(layout: SparseLayout, q_rows: torch.Tensor, k_tokens: torch.Tensor, v_tokens: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Decode rows without copying keys: per KV head, scores only where a query row meets its own keys
    (`sampled_addmm` on the block-sparse pattern), a softmax per row, then `sparse.mm` with the values.
    q_rows [rows, heads, dim], k/v_tokens [total_k, kv_heads, dim]; returns [rows, heads, dim]."""
    rows, heads, dim = q_rows.shape
    total_k, kv_heads, v_dim = v_tokens.shape
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    size = (kv_heads, rows * groups, total_k)
    # Query head h reads KV head h // groups, as in repeat_kv / enable_gqa
    queries = q_rows.reshape(rows, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads, rows * groups, dim)
    pattern = torch.sparse_csr_tensor(layout.crow, layout.col, layout.zeros.to(q_rows.dtype), size=size,
                                      check_invariants=False)
    scores = torch.sparse.sampled_addmm(pattern, queries, k_tokens.permute(1, 2, 0), beta=0.0, alpha=scale)
    scores = scores.values()  # [kv_heads, nnz]
    row_max = torch.segment_reduce(scores.t(), "max", lengths=layout.lengths, axis=0)  # [rows * groups, kv_heads]
    weights = (scores - row_max.t().index_select(1, layout.row_ids)).exp_()
    row_sum = torch.segment_reduce(weights.t(), "sum", lengths=layout.lengths, axis=0)
    weights /= row_sum.t().index_select(1, layout.row_ids)
    crow, col = layout.crow[0], layout.col[0]
    values = v_tokens.transpose(0, 1)  # [kv_heads, total_k, v_dim]
    out = torch.stack([
        torch.sparse.mm(torch.sparse_csr_tensor(crow, col, weights[h], size=size[1:], check_invariants=False),
                        values[h])
        for h in range(kv_heads)
    ])  # [kv_heads, rows * groups, v_dim]
    return out.view(kv_heads, rows, groups, v_dim).transpose(0, 1).reshape(rows, heads, v_dim)

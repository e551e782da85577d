"""Pure-torch reference attention over the paged KV cache.

Caches are [num_blocks, block_size, num_kv_heads, head_dim]. New keys/values are scattered to
their slots; decodes gather their blocks into one padded batch and attend with a length mask;
each prefill chunk gathers its context and runs SDPA with a causal mask aligned to its
position. Faster backends are checked against this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, kv_heads, head_dim] into their slots."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim]: the blocks' tokens in order.

    index_select over whole-block rows copies contiguous runs; advanced indexing on the 4-D
    cache was several times slower here.
    """
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    rows = torch.index_select(cache.view(num_blocks, -1), 0, block_ids)
    return rows.view(-1, kv_heads, head_dim)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, kv_heads, head_dim] of one request, in position order."""
    return gather_blocks(cache, block_table)[:seq_len]


def causal_mask(query_len: int, seq_len: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where attending is allowed; queries are the last positions."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class TorchReferenceBackend:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        """query: [num_tokens, heads, head_dim]; key/value: [num_tokens, kv_heads, head_dim].

        Returns [num_tokens, heads * head_dim].
        """
        k_cache, v_cache = kv_cache
        self._write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(query[:meta.num_decodes], k_cache, v_cache, meta)
        if meta.prefills:
            self._prefills(query, key, value, k_cache, v_cache, meta, out)
        return out.view(query.shape[0], -1)

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def _prefills(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  out: torch.Tensor) -> None:
        """Every prefill chunk's attention into its rows of out, one chunk at a time."""
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(query[rows], key[rows], value[rows], k_cache, v_cache,
                                      span, meta.sliding_window)

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """query: [num_decodes, heads, head_dim]; each attends to its padded block table."""
        num, max_blocks = meta.decode_block_table.shape
        width = max_blocks * k_cache.shape[1]
        flat_table = meta.decode_block_table.view(-1)
        # [num, kv_heads, width, head_dim] views of one gathered copy; SDPA takes the strides.
        keys = gather_blocks(k_cache, flat_table).view(num, width, self.num_kv_heads,
                                                       self.head_dim).transpose(1, 2)
        values = gather_blocks(v_cache, flat_table).view(num, width, self.num_kv_heads,
                                                         self.head_dim).transpose(1, 2)
        mask = meta.decode_mask(width).to(query.dtype)
        out = F.scaled_dot_product_attention(
            query.view(num, self.num_heads, 1, self.head_dim), keys, values, attn_mask=mask,
            scale=self.scale, enable_gqa=True)
        return out.view(num, self.num_heads, self.head_dim)

    def _prefill(self, query, key, value, k_cache, v_cache, span, window) -> torch.Tensor:
        if span.seq_len == span.query_len and window is None:
            keys, values = key, value   # nothing cached before: attend to the chunk itself
            mask, causal = None, True
        else:
            keys = gather_context(k_cache, span.block_table, span.seq_len)
            values = gather_context(v_cache, span.block_table, span.seq_len)
            mask = causal_mask(span.query_len, span.seq_len, window, query.device)
            causal = False
        # 4-D [1, heads, len, head_dim]: with 3-D inputs torch picks the unfused math path,
        # 2-4x slower on CPU than its flash kernel for prefill chunk shapes. Contiguous heads:
        # a 3000-token prompt's prefill took 3.55 s against 3.74 on transposed views (same
        # tokens and logprobs), the copies included.
        out = F.scaled_dot_product_attention(
            *(x.transpose(0, 1).contiguous().unsqueeze(0) for x in (query, keys, values)),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)

"""AttentionMetadata: the per-step description of the batch that every attention layer reads.

The batch is flattened to [num_tokens]; decodes (one new token each) come first, then prefill
chunks. Built once per step by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class PrefillSpan:
    query_start: int              # first row of this request in the flattened batch
    query_len: int                # new tokens this step
    seq_len: int                  # tokens in context after this step (cached + new)
    block_table: torch.Tensor     # [num_blocks_needed] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] long: cache slot of each new token
    num_decodes: int                    # the first num_decodes rows are single-token decodes
    decode_block_table: torch.Tensor    # [num_decodes, max_blocks] long, padded with 0
    decode_seq_lens: torch.Tensor       # [num_decodes] long: context length incl. the new token
    prefills: list[PrefillSpan]
    sliding_window: int | None = None   # attend to at most this many latest positions
    _decode_mask: torch.Tensor | None = field(default=None, init=False, repr=False,
                                              compare=False)

    def decode_mask(self, width: int) -> torch.Tensor:
        """[num_decodes, 1, 1, width] additive mask over the padded contexts (width: the
        block table's slots), for the reference backend. Built on first use, once a step: the
        kernels never read it (building it cost ~15 us a step)."""
        if self._decode_mask is None or self._decode_mask.shape[-1] != width:
            self._decode_mask = decode_mask(self.decode_seq_lens, width, self.sliding_window)
        return self._decode_mask

    @cached_property
    def packed_prefills(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill spans as one int64 [num_spans, 4] tensor (query_start, query_len,
        seq_len, offset of the span's blocks) and their block tables end to end: what a kernel
        taking every chunk of the step in one call reads. Built on first use, once a step."""
        offsets, offset = [], 0
        for span in self.prefills:
            offsets.append(offset)
            offset += span.block_table.numel()
        device = self.slot_mapping.device
        spans = torch.tensor([[span.query_start, span.query_len, span.seq_len, start]
                              for span, start in zip(self.prefills, offsets)],
                             dtype=torch.long, device=device).view(-1, 4)
        tables = (torch.cat([span.block_table for span in self.prefills]) if self.prefills
                  else torch.empty(0, dtype=torch.long, device=device))
        return spans, tables


@dataclass
class ForwardContext:
    """Passed explicitly through the model: what attention needs besides q, k, v."""
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: key/value caches


def decode_mask(seq_lens: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[num_decodes, 1, 1, width] additive mask over padded contexts: 0 where the one new
    query may attend, -inf past the request's end (and before its sliding window)."""
    positions = torch.arange(width, device=seq_lens.device).view(1, -1)
    last = seq_lens.view(-1, 1)
    masked = positions >= last
    if window is not None:
        masked |= positions < last - window
    mask = torch.zeros(masked.shape, dtype=torch.float32, device=seq_lens.device)
    return mask.masked_fill_(masked, float("-inf")).view(-1, 1, 1, width)

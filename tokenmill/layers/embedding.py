"""Token embeddings, read from a tied lm_head's compact panels where those hold the table.

A model with tied embeddings (SmolLM2) looks up prompt and decode tokens in the same
[vocab, hidden] table the lm_head multiplies by. Once the lm_head keeps that table as exact
Q8_0 or Q4_1 panels (layers/linear.py), the fp32 copy in nn.Embedding is 113 MB read a few
rows at a time: those rows sit cold between lookups, and on this VM cold memory reads slowly
(a 300-token prompt's rows took 4-7 ms, ~15 us a row, on 4 KB or huge pages alike). The
panels are read whole by the lm_head every step, so a row rebuilt from them is warm; it is
also the same fp32 value (the packer checked every weight), so the output does not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel


class Embedding(nn.Embedding):
    """nn.Embedding, or rows of compact panels once `read_from_panels` has dropped the table."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.panels: torch.Tensor | None = None

    def read_from_panels(self, panels: torch.Tensor) -> None:
        """Take rows from `panels` (a tied lm_head's gemv_compact, the same values as this
        table) and drop the fp32 table."""
        kernel = load_gemv_kernel()
        if kernel is None:
            raise ValueError("embedding: compact panels need the cpu_gemv kernel")
        rows = kernel.compact_panel_rows(panels, torch.arange(self.num_embeddings))
        if rows.shape != self.weight.shape or not torch.equal(rows, self.weight):
            raise ValueError("embedding: the panels do not hold this table's values")
        self.panels = panels
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            return F.embedding(input_ids, self.weight)
        return load_gemv_kernel().compact_panel_rows(self.panels, input_ids)

"""Log-probabilities of chosen tokens, their ranks and the top-N alternatives."""

from __future__ import annotations

import torch

from tokenmill.outputs import TokenLogprobs


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs: [rows, vocab] log-softmax; token_ids: [rows] chosen ids; num_top: N per row."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))                  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1                          # [rows]
    max_top = max(num_top, default=0)
    top_values, top_ids = (logprobs.topk(max_top, dim=1) if max_top
                           else (logprobs[:, :0], token_ids.view(-1, 1)[:, :0]))
    chosen_l, ranks_l = chosen.view(-1).tolist(), ranks.tolist()
    ids_l, top_values_l, top_ids_l = token_ids.tolist(), top_values.tolist(), top_ids.tolist()
    result = []
    for row, n in enumerate(num_top):
        result.append(TokenLogprobs(
            token_ids=[ids_l[row]] + top_ids_l[row][:n],
            logprobs=[chosen_l[row]] + top_values_l[row][:n],
            ranks=[ranks_l[row]] + list(range(1, n + 1))))
    return result

"""The worker's own record of each request it is computing (kept across steps)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.outputs import NewRequestData
from tokenmill.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]             # prompt + outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int

    @classmethod
    def from_new(cls, data: NewRequestData) -> "RequestState":
        return cls(data.request_id, list(data.token_ids), data.num_prompt_tokens,
                   data.sampling_params, data.seed, list(data.block_ids),
                   data.num_computed_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

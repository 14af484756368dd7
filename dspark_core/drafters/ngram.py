"""Model-free n-gram / prompt-lookup proposer: copy what followed the latest earlier match of the suffix."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.proposer import Draft


@dataclass
class _NgramState:
    history: list[int] = field(default_factory=list)


def ngram_lookup(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of seq's longest matching suffix."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n:]
        first = suffix[0]
        for start in range(L - n - 1, -1, -1):      # most recent occurrence first, not the suffix itself
            if seq[start] == first and seq[start:start + n] == suffix:
                follow = seq[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    name = "ngram"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, block_size: int = 7, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_block = block_size
        self.max_n, self.min_n = max_n, min_n

    def start(self, prompt_ids: list[int], taps: torch.Tensor | None) -> _NgramState:
        return _NgramState(list(prompt_ids))

    def propose(self, state: _NgramState, anchor: int, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        toks = ngram_lookup(state.history + [anchor], min(k, self.max_block), self.max_n, self.min_n)
        return Draft(torch.tensor(toks, dtype=torch.long))

    def commit(self, state: _NgramState, tokens: list[int], taps: torch.Tensor | None) -> None:
        state.history.extend(tokens)

"""The one small interface every proposer implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark_core.engine.sampling import SamplingParams


@dataclass
class Draft:
    """What a proposer returns for one request and one round.

    tokens: [k] long. draft_probs: [k, vocab] fp32, the exact distribution each token was drawn from
    (None when the tokens are deterministic proposals, i.e. one-hot, or when sampling is greedy).
    confidence_logits: [k] raw confidence-head logits (DSpark only), else None.
    calibrated: the confidence logits are already the logit of each position's acceptance probability
    (given the previous ones accepted) and take no drafter calibration, nor belong in the traces that
    calibrate a confidence head (prompt-lookup copies scored from their observed acceptance).
    """

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    calibrated: bool = False

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, k: int) -> "Draft":
        return Draft(self.tokens[:k],
                     None if self.draft_probs is None else self.draft_probs[:k],
                     None if self.confidence_logits is None else self.confidence_logits[:k], self.calibrated)


class Proposer(Protocol):
    """A draft-token proposer for a single request stream.

    Lifecycle: ``start`` after the target prefilled the prompt, then per round ``propose`` (given the
    anchor, i.e. the last token the target chose, not yet in the target cache) and ``commit`` (the
    tokens now in the target cache: the anchor and the accepted drafts, with their target taps).
    """

    name: str
    tap_layers: tuple[int, ...]   # target layers whose raw outputs this proposer consumes
    max_block: int                # most draft tokens one propose can return

    def start(self, prompt_ids: list[int], taps: torch.Tensor | None) -> object: ...

    def propose(self, state: object, anchor: int, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft: ...

    def commit(self, state: object, tokens: list[int], taps: torch.Tensor | None) -> None: ...


def propose_many(proposer: Proposer, states: list, anchors: list[int], ks: list[int],
                 params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Draft | None]:
    """Drafts for several requests of one proposer: one batched call when the proposer has
    ``propose_batch`` (one backbone pass for all rows), else ``propose`` per request. ``k <= 0`` gives None."""
    batch = getattr(proposer, "propose_batch", None)
    if batch is not None and sum(k > 0 for k in ks) > 1:
        drafts = batch(states, anchors, ks, params, generators)
    else:
        drafts = [proposer.propose(s, a, k, p, g) if k > 0 else None
                  for s, a, k, p, g in zip(states, anchors, ks, params, generators)]
    return [d if k > 0 else None for d, k in zip(drafts, ks)]

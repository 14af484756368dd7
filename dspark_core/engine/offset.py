"""A request's own offset on its drafter's calibrated confidences (the engine applies it when sizing rounds)."""

from __future__ import annotations

import torch


class RequestOffset:
    """One request's own correction of its drafter's calibrated step probabilities, learned from its rounds.

    A pooled calibration is right on average over requests, but requests differ: one whose drafts are
    accepted more (or less) than its confidences say stays off the same way for much of its life. Each round
    this adds ``offset[k]`` to the logit of position ``k``'s step probability. The offset is a per-request
    logistic intercept fitted online (one Newton step per label, the Laplace / extended-Kalman update): each
    verified factor at position ``k`` (``y``: was the draft kept, given the ones before it were; ``p``: the
    probability it was sized with) adds ``p (1 - p)`` to the position's information, which starts at
    ``prior`` (pseudo-labels that keep a request with few rounds on the pooled calibration), and moves the
    offset by ``(y - p) / information``. Its fixed point is the request's true intercept. Labels come from
    every round, censored ones included: a round verifying ``l`` drafts and keeping ``n`` labels factors
    ``1..min(n + 1, l)``. ``l`` was chosen from the confidences, never from the outcome, so a constant
    intercept is learnt without bias; where the true correction is not constant, the confident rounds that
    reach later positions weigh more there (docs/serving.md measures what that costs served). It changes
    only how many drafts are verified, never which token is emitted."""

    __slots__ = ("prior", "offset", "info", "_used")

    def __init__(self, prior: float):
        if not prior > 0:
            raise ValueError(f"a request offset needs a prior > 0, got {prior}")
        self.prior = float(prior)
        self.offset: list[float] = []         # per position, the logit offset
        self.info: list[float] = []           # per position, prior + sum p (1 - p) of its labels
        self._used: list[float] = []          # the step probabilities the last draft was sized with

    def offsets(self, n: int) -> list[float]:
        return [self.offset[k] if k < len(self.offset) else 0.0 for k in range(n)]

    def adjust(self, probs: torch.Tensor) -> torch.Tensor:
        """Step probabilities [k] -> the same with this request's offsets on their logits (remembered for
        :meth:`update`)."""
        p = probs.float().clamp(1e-6, 1 - 1e-6)
        if any(self.offset):
            p = torch.sigmoid(torch.log(p) - torch.log1p(-p) + torch.tensor(self.offsets(len(p))))
        self._used = p.tolist()
        return p

    def update(self, verified: int, accepted: int) -> None:
        """The last sized draft's outcome: ``verified`` drafts checked, the first ``accepted`` of them kept."""
        used, self._used = self._used, []
        for k in range(min(accepted + 1, verified, len(used))):
            if k >= len(self.offset):
                self.offset.append(0.0)
                self.info.append(self.prior)
            p = used[k]
            self.info[k] += p * (1.0 - p)
            self.offset[k] += ((1.0 if k < accepted else 0.0) - p) / self.info[k]

"""Sampling parameters, the fp32 token distribution, and lossless rejection sampling.

One function (:func:`token_probs`) turns logits into the distribution that is used both to sample a
draft token and to accept it; the target's rows go through the same function, so temperature,
top-k and top-p are applied identically to draft and target. Every random draw takes an explicit
``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5
TOP_P_PROBE = 256         # candidates searched for the top-p nucleus before a full sort


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] -> fp32 probabilities [..., vocab] after temperature, top-k and top-p.

    Greedy (temperature ~ 0) gives the one-hot of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_top_p_drop(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


def _nucleus(sorted_p: torch.Tensor, order: torch.Tensor, vocab: int, top_p: float) -> torch.Tensor:
    """Kept-token mask [rows, vocab] from probabilities sorted descending [rows, n] and their ids."""
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.zeros(sorted_p.shape[0], vocab, dtype=torch.bool, device=sorted_p.device).scatter_(-1, order, keep)


def _top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask [..., vocab] of the tokens outside the nucleus: a token is dropped when the mass of the
    tokens ranked strictly before it already reaches ``top_p`` (the first always stays).

    The nucleus is looked for among the ``TOP_P_PROBE`` most likely tokens first; only rows whose
    nucleus reaches past them are sorted in full (on a CPU core a full sort of a 49k vocabulary per row
    costs about as much as a forward step of a small target; the probe a small fraction of it).
    """
    V = logits.shape[-1]
    probs = logits.reshape(-1, V).softmax(-1)
    top, idx = probs.topk(min(TOP_P_PROBE, V), dim=-1)                  # descending
    keep = _nucleus(top, idx, V, top_p)
    if idx.shape[-1] < V:
        wide = ((top.cumsum(-1) - top)[:, -1] < top_p).nonzero().flatten()  # nucleus wider than the probe
        if wide.numel():
            keep[wide] = _nucleus(*probs[wide].sort(-1, descending=True), V, top_p)
    return ~keep.view(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] -> [...] (long), by inverting the row's cumulative
    distribution at one uniform draw (fp64): one cumulative sum and a binary search per row, where
    ``torch.multinomial`` draws a random number per vocabulary entry."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    cdf = flat.double().cumsum(-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)          # first entry with cdf > u * total
    # u * total rounds up to the total only in the last bit: stay on the last token with mass
    last = V - 1 - (flat > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    return torch.minimum(idx, last).view(probs.shape[:-1])


def draw(logits: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token from logits [vocab]: (token, the fp32 distribution it was drawn from or None if greedy)."""
    if params.greedy:
        return logits.argmax(), None
    probs = token_probs(logits, params)
    return sample(probs, generator), probs


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Standard speculative sampling for one request.

    draft_tokens: [k] long; draft_probs: [k, vocab] fp32, or None when every draft token was proposed
    deterministically (one-hot proposal, e.g. n-gram); target_probs: [k + 1, vocab] fp32.
    Returns (number of accepted draft tokens n, the recovered token at row n if n < k, else the
    bonus token sampled from row k). The committed output is distributed exactly as the target.
    """
    k = draft_tokens.shape[0]
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, vocab] = [{k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs[:k].shape:
        raise ValueError(f"draft_probs must be [k, vocab] = {tuple(target_probs[:k].shape)}, got {tuple(draft_probs.shape)}")
    if k == 0:
        return 0, int(sample(target_probs[0], generator))
    dev = target_probs.device
    draft_tokens = draft_tokens.to(dev)
    idx = torch.arange(k, device=dev)
    p_target = target_probs[idx, draft_tokens]                                   # [k]
    p_draft = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones(k, device=dev)
    u = torch.rand(k, generator=generator, device=dev)
    accept = u * p_draft.clamp_min(1e-8) < p_target  # u < p_target / p_draft, without a division
    n = k if bool(accept.all()) else int((~accept).nonzero()[0])
    if n == k:
        return k, int(sample(target_probs[k], generator))
    if draft_probs is not None:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)
    else:
        residual = target_probs[n].clone()
        residual[draft_tokens[n]] = 0.0
    if float(residual.sum()) <= 1e-8:
        residual = target_probs[n]
    return n, int(sample(residual / residual.sum(), generator))


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy special case of :func:`rejection_sample` (one-hot draft and target): argmax comparisons only.

    target_logits: [k + 1, vocab]. Returns (accepted count, correction or bonus token).
    """
    return greedy_accept(draft_tokens, target_logits.argmax(-1))


def greedy_accept(draft_tokens: torch.Tensor, best: torch.Tensor) -> tuple[int, int]:
    """:func:`greedy_verify` from the target's argmax ids ``best`` [k + 1] (taken once for a whole batch)."""
    k = draft_tokens.shape[0]
    if k == 0:
        return 0, int(best[0])
    match = best[:k] == draft_tokens.to(best.device)
    n = k if bool(match.all()) else int((~match).nonzero()[0])
    return n, int(best[n])

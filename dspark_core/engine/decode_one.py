"""The speculative decode loop for one request: draft, verify in one target forward, accept, commit.

Plain decoding is the same loop with no proposer (every round verifies only the anchor), so the
baseline shares the runner, the cache and the sampling code with speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dspark_core.engine.proposer import Proposer
from dspark_core.engine.stats import AcceptanceStats
from dspark_core.model.runner import TargetRunner
from dspark_core.engine.sampling import SamplingParams, draw, greedy_verify, rejection_sample, token_probs


@dataclass
class GenerationResult:
    token_ids: list[int]          # generated ids only (stop token included if produced)
    stats: AcceptanceStats
    finish_reason: str            # "stop" or "length"


def _first_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> int:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return -1


def generate(runner: TargetRunner, prompt_ids: list[int], params: SamplingParams,
             proposer: Proposer | None = None, block_size: int | None = None,
             generator: torch.Generator | None = None, record_rounds: bool = False) -> GenerationResult:
    """Generate up to ``params.max_new_tokens`` tokens after ``prompt_ids``; lossless w.r.t. the target.

    Every round verifies the whole draft (so with ``record_rounds`` each round's acceptance label is
    uncensored and can calibrate the confidence head)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = runner.arch.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got min {min(prompt_ids)} max {max(prompt_ids)}")
    t0 = time.perf_counter()
    stats = AcceptanceStats(round_log=[] if record_rounds else None)
    k_max = 0 if proposer is None else (block_size or proposer.max_block)
    taps = () if proposer is None else tuple(proposer.tap_layers)
    cache = runner.new_cache(1, len(prompt_ids) + params.max_new_tokens + k_max + 8)

    out = runner.forward(cache, torch.tensor([prompt_ids]), taps=taps, logits="last")
    logits = out.logits[0, -1]
    first = int(draw(logits, params, generator)[0])
    tokens = [first]
    state = proposer.start(list(prompt_ids), out.taps[0] if taps else None) if proposer is not None else None
    stop = params.stop_token_ids
    finish = "stop" if first in stop else "length"

    while finish != "stop" and len(tokens) < params.max_new_tokens:
        remaining = params.max_new_tokens - len(tokens)
        anchor = tokens[-1]
        k = min(k_max, remaining - 1)
        t_draft = time.perf_counter()
        draft = proposer.propose(state, anchor, k, params, generator) if (proposer is not None and k > 0) else None
        draft_tokens = draft.tokens if draft is not None else torch.empty(0, dtype=torch.long)
        n_draft = int(draft_tokens.shape[0])
        start = cache.lengths[0]
        ids = torch.cat([torch.tensor([anchor]), draft_tokens])[None]
        t_verify = time.perf_counter()
        out = runner.forward(cache, ids, taps=taps, logits="all")
        stats.draft_seconds += t_verify - t_draft
        stats.verify_seconds += time.perf_counter() - t_verify
        if params.greedy:
            n, nxt = greedy_verify(draft_tokens, out.logits[0])
        else:
            n, nxt = rejection_sample(draft_tokens, draft.draft_probs if draft is not None else None,
                                      token_probs(out.logits[0], params), generator)
        cache.truncate(0, start + n + 1)               # keep the anchor and the accepted drafts
        new = draft_tokens[:n].tolist() + [nxt]
        cut = _first_stop(new, stop)
        if cut >= 0:
            new = new[:cut + 1]
            finish = "stop"
        new = new[:remaining]
        conf = draft.confidence_logits.tolist() if (record_rounds and draft is not None and not draft.calibrated
                                                     and draft.confidence_logits is not None) else None
        stats.observe(drafted=n_draft, verified=n_draft, accepted=min(n, len(new)), emitted=len(new),
                      confidence_logits=conf)
        if proposer is not None:
            proposer.commit(state, [anchor] + draft_tokens[:n].tolist(), out.taps[0, :n + 1] if taps else None)
        tokens.extend(new)

    stats.wall_seconds = time.perf_counter() - t0
    if finish != "stop" and tokens and tokens[-1] in stop:
        finish = "stop"
    return GenerationResult(tokens, stats, finish)

"""The speculative decode loop for one request: draft, verify in one target forward, accept, commit.

Plain decoding is the same loop with no proposer (every round verifies only the anchor), so the
baseline shares the runner, the cache and the sampling code with speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .proposers.base import Proposer
from .runner import TargetRunner
from .sampling import SamplingParams, draw, greedy_verify, rejection_sample, token_probs


@dataclass
class AcceptanceStats:
    """Per-request speculation statistics (plain data; sinks such as metrics consume it)."""

    rounds: int = 0
    drafted: int = 0        # draft tokens proposed
    verified: int = 0       # draft tokens sent to the target
    accepted: int = 0       # draft tokens accepted
    emitted: int = 0        # tokens committed by rounds (accepted + recovered/bonus)
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0    # in the proposer's propose() (generate() only; prefill not included)
    verify_seconds: float = 0.0   # in the target's verify forwards after the prefill (a plain step's forward
                                  # when nothing is drafted)
    # per round (only when recording): drafted, verified, accepted, full_verify, raw confidence logits
    round_log: list[dict] | None = None

    def observe(self, drafted: int, verified: int, accepted: int, emitted: int, full_verify: bool = True,
                confidence_logits: list[float] | None = None) -> None:
        if self.round_log is not None:
            self.round_log.append({"drafted": drafted, "verified": verified, "accepted": accepted,
                                   "full_verify": full_verify and verified == drafted,
                                   "confidence_logits": confidence_logits})
        self.rounds += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        self.emitted += emitted
        for lst, n in ((self.verified_per_position, verified), (self.accepted_per_position, accepted)):
            if len(lst) < n:
                lst.extend([0] * (n - len(lst)))
            for i in range(n):
                lst[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, the recovered/bonus token included."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "verified": self.verified,
                "accepted": self.accepted, "emitted": self.emitted,
                "accepted_per_position": list(self.accepted_per_position),
                "verified_per_position": list(self.verified_per_position),
                "tau": round(self.tau, 4), "wall_seconds": round(self.wall_seconds, 4)}


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

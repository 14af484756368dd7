"""Held-out evaluation of proposers: acceptance length, acceptance per position, measured speedup."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .decode import AcceptanceStats, generate
from .proposers.base import Proposer
from .runner import TargetRunner
from .sampling import SamplingParams


@dataclass
class EvalResult:
    """Aggregates over prompts for one proposer at one temperature (plain data)."""

    drafter: str
    temperature: float
    prompts: int = 0
    rounds: int = 0
    emitted: int = 0
    tokens: int = 0
    seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    per_prompt_tau: list[float] = field(default_factory=list)

    def add(self, stats: AcceptanceStats, n_tokens: int) -> None:
        self.prompts += 1
        self.rounds += stats.rounds
        self.emitted += stats.emitted
        self.tokens += n_tokens
        self.seconds += stats.wall_seconds
        for mine, theirs in ((self.accepted_per_position, stats.accepted_per_position),
                             (self.verified_per_position, stats.verified_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.per_prompt_tau.append(stats.tau)

    @property
    def tau(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def acceptance_per_position(self) -> list[float]:
        """P(draft slot i accepted | slot i verified): unconditional prefix survival per slot."""
        acc = self.accepted_per_position + [0] * (len(self.verified_per_position) - len(self.accepted_per_position))
        return [a / v if v else 0.0 for a, v in zip(acc, self.verified_per_position)]

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "temperature": self.temperature, "prompts": self.prompts,
                "tau": round(self.tau, 4), "tau_median_prompt": round(statistics.median(self.per_prompt_tau), 4)
                if self.per_prompt_tau else 0.0, "acceptance_per_position": [round(x, 4) for x in
                                                                            self.acceptance_per_position()],
                "tokens": self.tokens, "seconds": round(self.seconds, 3), "tok_s": round(self.tok_s, 3)}


def evaluate_side_by_side(runner: TargetRunner, proposers: dict[str, Proposer | None], prompts: list[list[int]],
                          params: SamplingParams, seed: int = 0, log=None,
                          block_size: int | None = None, scheduled: dict | None = None) -> dict[str, EvalResult]:
    """Run every proposer (``None`` = plain engine) on every prompt, interleaved prompt by prompt, so that
    machine noise hits all of them alike. Returns one :class:`EvalResult` per name.

    ``scheduled``: extra entries ``name -> (proposer, policy, calibrate)`` run through the batched engine
    (:func:`~dspark_core.spec_batch.run_requests`, batch 1) with that verify-length policy and
    confidence calibration; their time is the wall time of the whole request, prefill included."""
    from .spec_batch import SpecRequest, run_requests
    scheduled = scheduled or {}
    results = {name: EvalResult(name, params.temperature) for name in [*proposers, *scheduled]}
    generate(runner, prompts[0], SamplingParams(max_new_tokens=4))                 # warm-up, untimed
    for i, ids in enumerate(prompts):
        for name, prop in proposers.items():
            gen = torch.Generator(device=runner.device).manual_seed(seed + i)
            res = generate(runner, ids, params, prop, block_size=block_size, generator=gen)
            results[name].add(res.stats, len(res.token_ids))
        for name, (prop, policy, calibrate) in scheduled.items():
            gen = torch.Generator(device=runner.device).manual_seed(seed + i)
            req = SpecRequest(name, list(ids), params, prop, gen, calibrate=calibrate)
            t0 = time.perf_counter()
            run_requests(runner, [req], policy, max_batch=1)
            req.stats.wall_seconds = time.perf_counter() - t0
            results[name].add(req.stats, len(req.tokens))
        if log:
            log(f"  prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{n} tau {r.tau:.2f} {r.tok_s:.1f} tok/s" for n, r in results.items()))
    return results


def speedups(results: dict[str, EvalResult], baseline: str = "none") -> dict[str, float]:
    """tok/s of each proposer divided by the plain engine's tok/s measured in the same run."""
    base = results[baseline].tok_s
    return {name: round(r.tok_s / base, 4) if base else 0.0 for name, r in results.items()}

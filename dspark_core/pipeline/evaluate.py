"""Held-out evaluation of proposers: acceptance length, acceptance per position, measured speedup."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from dspark_core.engine.decode_one import generate
from dspark_core.engine.stats import AcceptanceStats
from dspark_core.engine.proposer import Proposer
from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from dspark_core.model.runner import TargetRunner


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
    # per prompt, in prompt order: (emitted, rounds, tokens) of the first pass and the seconds counted for it
    # (:func:`evaluate_side_by_side`: the median over its timed passes); :func:`paired_ratios` resamples them
    per_prompt: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_seconds: list[float] = field(default_factory=list)
    # where a round's time goes, summed over every timed pass (see :meth:`add_timing`)
    timed_rounds: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add_timing(self, stats: AcceptanceStats) -> None:
        """Count one timed generation's drafting and verify-forward seconds (``generate`` measures them;
        a generation that did not is skipped)."""
        if stats.verify_seconds > 0.0:
            self.timed_rounds += stats.rounds
            self.draft_seconds += stats.draft_seconds
            self.verify_seconds += stats.verify_seconds

    def round_ms(self) -> dict | None:
        """Mean milliseconds per round in drafting and in the verify forward (None when not timed)."""
        if not self.timed_rounds:
            return None
        return {"draft": round(1e3 * self.draft_seconds / self.timed_rounds, 3),
                "verify": round(1e3 * self.verify_seconds / self.timed_rounds, 3)}

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
        self.per_prompt.append((stats.emitted, stats.rounds, n_tokens))
        self.prompt_seconds.append(stats.wall_seconds)

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
                "tokens": self.tokens, "seconds": round(self.seconds, 3), "tok_s": round(self.tok_s, 3),
                "round_ms": self.round_ms()}


@dataclass(frozen=True)
class SideBySide:
    """How :func:`evaluate_side_by_side` runs each generation."""

    params: SamplingParams
    seed: int = 0                        # prompt i's generator is seeded with seed + i
    block_size: int | None = None        # draft block size (None: each proposer's own)
    reps: int = 1                        # passes over the prompts (each prompt's time: its median)

    def __post_init__(self):
        if self.reps < 1:
            raise ValueError("reps must be >= 1")


def evaluate_side_by_side(runner: TargetRunner, proposers: dict[str, Proposer | None], prompts: list[list[int]],
                          how: SideBySide, scheduled: dict | None = None, log=None) -> dict[str, EvalResult]:
    """Run every proposer (``None`` = plain engine) on every prompt, interleaved prompt by prompt, so that
    machine noise hits all of them alike. Returns one :class:`EvalResult` per name.

    ``how.reps`` > 1 repeats the whole pass, the proposers in a rotated order each time (none always first
    is a position, and a 2-core machine's speed drifts); every generation is seeded the same way in each
    repetition, so outputs and acceptance are those of the first, and each prompt's time is its median
    over the repetitions (one slow spell then moves no proposer's figure).

    ``scheduled``: extra entries ``name -> (proposer, policy, calibrate)`` run through the batched engine
    (:func:`~dspark_core.engine.spec_batch.run_requests`, batch 1) with that verify-length policy and
    confidence calibration; their time is the wall time of the whole request, prefill included."""
    params, block_size, reps = how.params, how.block_size, how.reps
    scheduled = scheduled or {}
    names = [*proposers, *scheduled]
    results = {name: EvalResult(name, params.temperature) for name in names}
    times: dict[str, list[list[float]]] = {name: [[] for _ in prompts] for name in names}
    # warm-up, untimed: each proposer's first call pays one-time costs (kernel selection for new shapes,
    # allocations), which would otherwise all land on the first proposer timed on the first prompt
    warm = SamplingParams(max_new_tokens=8)
    generate(runner, prompts[0], warm)
    for prop in proposers.values():
        if prop is not None:
            generate(runner, prompts[0], warm, prop, block_size=block_size)
    for prop, policy, calibrate in scheduled.values():
        run_requests(runner, [SpecRequest("warm-up", list(prompts[0]), warm, prop, calibrate=calibrate)], policy,
                     max_batch=1)

    def run_one(name: str, i: int, ids: list[int]):
        gen = torch.Generator(device=runner.device).manual_seed(how.seed + i)
        if name in proposers:
            res = generate(runner, ids, params, proposers[name], block_size=block_size, generator=gen)
            return res.stats, len(res.token_ids), res.stats.wall_seconds
        prop, policy, calibrate = scheduled[name]
        req = SpecRequest(name, list(ids), params, prop, gen, calibrate=calibrate)
        t0 = time.perf_counter()
        run_requests(runner, [req], policy, max_batch=1)
        return req.stats, len(req.tokens), time.perf_counter() - t0

    for rep in range(reps):
        shift = rep % len(names)
        order = names[shift:] + names[:shift]
        for i, ids in enumerate(prompts):
            for name in order:
                stats, n_tokens, seconds = run_one(name, i, ids)
                if rep == 0:
                    results[name].add(stats, n_tokens)
                results[name].add_timing(stats)
                times[name][i].append(seconds)
            if log:
                log(f"  {f'rep {rep + 1}/{reps} ' if reps > 1 else ''}prompt {i + 1}/{len(prompts)}: " + ", ".join(
                    f"{n} tau {r.tau:.2f} {r.tokens / sum(statistics.median(t) for t in times[n] if t):.1f} tok/s"
                    for n, r in results.items()))
    for name in names:
        results[name].prompt_seconds = [statistics.median(t) for t in times[name]]
        results[name].seconds = sum(results[name].prompt_seconds)
    return results


def speedups(results: dict[str, EvalResult], baseline: str = "none") -> dict[str, float]:
    """tok/s of each proposer divided by the plain engine's tok/s measured in the same run."""
    base = results[baseline].tok_s
    return {name: round(r.tok_s / base, 4) if base else 0.0 for name, r in results.items()}


def paired_ratios(results: dict[str, EvalResult], a: str, b: str, resamples: int = 2000, seed: int = 0,
                  quantiles: tuple[float, float] = (0.05, 0.95)) -> dict:
    """``a`` against ``b`` measured on the same prompts: tau(a) / tau(b) and tok/s(a) / tok/s(b), each as its
    value and the ``quantiles`` of the ratio over paired resamples of the prompts (a resample draws prompts
    with replacement and keeps the two drafters' figures of a drawn prompt together, so a prompt that is easy
    or slow for both moves neither ratio). With ``b`` = the plain engine the speed ratio is the speedup.

    The range says how far the ratio could move on another draw of prompts like these: a ratio whose range
    excludes 1 is a difference these prompts resolve; more prompts narrow it (about as 1 / sqrt(prompts))."""
    ra, rb = results[a], results[b]
    n = len(ra.per_prompt)
    if n == 0 or len(rb.per_prompt) != n or len(ra.prompt_seconds) != n or len(rb.prompt_seconds) != n:
        raise ValueError(f"{a} and {b} were not measured on the same prompts")

    def ratios(idx) -> tuple[float, float]:
        em_a = sum(ra.per_prompt[i][0] for i in idx)
        ro_a = sum(ra.per_prompt[i][1] for i in idx)
        em_b = sum(rb.per_prompt[i][0] for i in idx)
        ro_b = sum(rb.per_prompt[i][1] for i in idx)
        tau_a, tau_b = (em_a / ro_a if ro_a else 0.0), (em_b / ro_b if ro_b else 0.0)
        sp_a = sum(ra.per_prompt[i][2] for i in idx) / max(sum(ra.prompt_seconds[i] for i in idx), 1e-12)
        sp_b = sum(rb.per_prompt[i][2] for i in idx) / max(sum(rb.prompt_seconds[i] for i in idx), 1e-12)
        return (tau_a / tau_b if tau_b else 0.0), (sp_a / sp_b if sp_b else 0.0)

    tau, speed = ratios(range(n))
    rng = random.Random(seed)
    draws = [ratios([rng.randrange(n) for _ in range(n)]) for _ in range(resamples if n > 1 else 0)]

    def entry(value: float, k: int) -> dict:
        if not draws:
            return {"value": round(value, 4), "low": round(value, 4), "high": round(value, 4)}
        v = sorted(d[k] for d in draws)
        pick = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]   # noqa: E731
        return {"value": round(value, 4), "low": round(pick(quantiles[0]), 4), "high": round(pick(quantiles[1]), 4)}

    return {"prompts": n, "tau_ratio": entry(tau, 0), "speed_ratio": entry(speed, 1),
            "quantiles": list(quantiles)}

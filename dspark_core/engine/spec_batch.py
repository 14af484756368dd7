"""One batched speculative step over many requests, and a continuous-batching driver.

Each request carries its own proposer state, sampling parameters and generator. Per step: the
verify-length policy (:class:`~dspark_core.engine.policy.VerifyPolicy`) picks the requests that draft,
each of them drafts a full block, the policy picks ell_r per request from the (calibrated)
confidences; one target forward verifies all ragged blocks (packed); each row is accepted by its own
rejection sampler, rolled back in O(1) and committed. Requests join and leave between steps, so a
request's output depends only on its own prompt, parameters and generator (up to floating-point
rounding of batched matmuls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark_core.engine.offset import RequestOffset
from dspark_core.engine.policy import VerifyPolicy, check_policy
from dspark_core.engine.proposer import Draft, Proposer, propose_many
from dspark_core.engine.sampling import SamplingParams, draw, greedy_accept, rejection_sample, token_probs
from dspark_core.engine.stats import AcceptanceStats
from dspark_core.model.layers import KVCache
from dspark_core.model.runner import ForwardOutput, TargetRunner, select_taps


@dataclass
class SpecRequest:
    key: object
    prompt_ids: list[int]
    params: SamplingParams
    proposer: Proposer | None = None
    generator: torch.Generator | None = None
    calibrate: Callable[[torch.Tensor], torch.Tensor] | None = None   # raw conf logits -> step probs
    record_rounds: bool = False                                        # keep a per-round log in stats
    record_confidences: bool = True                                    # ... with the raw confidence logits
    adapt: RequestOffset | None = None     # this request's own offset on the calibrated probabilities
    # filled while running
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    row: int = -1
    state: object = None
    t_first: float | None = None       # seconds from joining to the first token (prefill)
    t_join: float | None = None        # perf_counter when the request joined a batch
    t_done: float | None = None        # perf_counter when it finished
    last_surv: torch.Tensor | None = None   # calibrated survival of the previous round's draft


class SpecBatch:
    """Requests sharing one target KV cache; ``step`` runs one speculative round for all of them.

    ``shadow_fraction``: that share of rounds verifies the whole drafted block whatever the policy says
    (drawn from the batch's own generator, never from the tokens, so sampling stays exact), and the
    round is marked ``full_verify``: uncensored acceptance labels for calibration and training. Without
    them, labels exist only for verified positions, and rounds the policy truncated look shorter than
    they would have been, which biases a refit toward the policy's own earlier beliefs.
    """

    def __init__(self, runner: TargetRunner, capacity: int = 512, shadow_fraction: float = 0.0,
                 seed: int = 0):
        if not 0.0 <= shadow_fraction <= 1.0:
            raise ValueError(f"shadow_fraction must be in [0, 1], got {shadow_fraction}")
        self.shadow_fraction = shadow_fraction
        self._shadow_gen = torch.Generator().manual_seed(seed)
        self.runner = runner
        self.cache: KVCache = runner.new_cache(1, capacity)
        self.cache.keep_rows([])                       # rows are added as requests join
        self.active: list[SpecRequest] = []
        self.capacity = capacity

    def _taps(self) -> tuple[int, ...]:
        return tuple(sorted({t for r in self.active if r.proposer is not None for t in r.proposer.tap_layers}))

    def add(self, req: SpecRequest) -> None:
        """Prefill a new request into a fresh cache row (between steps)."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.key!r} has an empty prompt")
        self.cache.reserve(len(req.prompt_ids) + req.params.max_new_tokens + 16)
        req.row = self.cache.add_rows(1)[0]
        try:
            self._prefill(req)
        except Exception:
            self.cache.keep_rows([r.row for r in self.active])     # drop the half-made row; others keep theirs
            raise
        self.active.append(req)

    def _prefill(self, req: SpecRequest) -> None:
        if req.record_rounds:
            req.stats.round_log = []
        taps = tuple(req.proposer.tap_layers) if req.proposer is not None else ()
        t0 = req.t_join = time.perf_counter()
        out = self.runner.forward(self.cache, torch.tensor([req.prompt_ids]), taps=taps, logits="last",
                                  rows=[req.row])
        first = int(draw(out.logits[0, -1], req.params, req.generator)[0])
        req.tokens = [first]
        req.t_first = time.perf_counter() - t0
        if req.proposer is not None:
            req.state = req.proposer.start(list(req.prompt_ids), out.taps[0] if taps else None)
        if first in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif req.params.max_new_tokens <= 1:
            req.finish_reason = "length"

    def remove_finished(self) -> list[SpecRequest]:
        done = [r for r in self.active if r.finish_reason is not None]
        now = time.perf_counter()
        for r in done:
            r.t_done = now
        if done:
            keep = [r for r in self.active if r.finish_reason is None]
            self.cache.keep_rows([r.row for r in keep])
            for i, r in enumerate(keep):
                r.row = i
            self.active = keep
        return done

    @staticmethod
    def _draft(reqs: list[SpecRequest], ks: list[int]) -> list[Draft | None]:
        """Drafts per request; requests sharing a proposer object are drafted in one batched call."""
        drafts: list[Draft | None] = [None] * len(reqs)
        groups: dict[int, list[int]] = {}
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if k > 0:
                groups.setdefault(id(r.proposer), []).append(i)
        for idx in groups.values():
            prop = reqs[idx[0]].proposer
            got = propose_many(prop, [reqs[i].state for i in idx], [reqs[i].tokens[-1] for i in idx],
                               [ks[i] for i in idx], [reqs[i].params for i in idx], [reqs[i].generator for i in idx])
            for i, d in zip(idx, got):
                drafts[i] = d
        return drafts

    def step(self, policy: VerifyPolicy) -> None:
        """One speculative round for every unfinished request, in five steps:

        1. plan: the policy says which rows draft at all (from each row's previous survival);
        2. draft: those rows propose a full block, scored into calibrated survival;
        3. size: the policy picks each row's verify length (shadow rounds verify the whole block);
        4. verify: one packed target forward over every row's anchor and verified drafts;
        5. accept: per row, rejection sampling (greedy match for greedy rows), O(1) rollback, commit.
        """
        reqs = [r for r in self.active if r.finish_reason is None]
        if not reqs:
            return
        t0 = time.perf_counter()
        may_draft = policy.plan([r.key for r in reqs], [r.last_surv for r in reqs])
        ks = [0 if (r.proposer is None or not go) else
              min(r.proposer.max_block, r.params.max_new_tokens - len(r.tokens) - 1) for r, go in zip(reqs, may_draft)]
        drafts = self._draft(reqs, ks)
        limits = [0 if d is None else len(d) for d in drafts]
        survs = [self._survival(r, d) for r, d in zip(reqs, drafts)]
        lengths = self._verify_lengths(policy, survs, limits)
        # raw confidence logits of the whole block, for rounds logged with them (calibration data)
        full_conf = [d.confidence_logits.tolist() if d is not None and d.confidence_logits is not None
                     and not d.calibrated and r.stats.round_log is not None and r.record_confidences else None
                     for d, r in zip(drafts, reqs)]
        drafts = [d.truncate(n) if d is not None else None for d, n in zip(drafts, lengths)]
        verified = self._verify(reqs, drafts)
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            self._accept(r, d, i, verified, limits[i], full_conf[i])
        dt = time.perf_counter() - t0
        for r in reqs:
            r.stats.wall_seconds += dt

    @staticmethod
    def _survival(r: SpecRequest, d: Draft | None) -> torch.Tensor | None:
        """Calibrated prefix survival [k] of a draft with confidences (kept as the row's ``last_surv`` for
        the next plan), else None (the row keeps its previous ``last_surv``)."""
        if d is None or d.confidence_logits is None or not len(d):
            return None
        probs = (r.calibrate(d.confidence_logits) if r.calibrate and not d.calibrated
                 else torch.sigmoid(d.confidence_logits))
        if r.adapt is not None:
            probs = r.adapt.adjust(probs)
        r.last_surv = torch.cumprod(probs.float(), 0)
        return r.last_surv

    def _verify_lengths(self, policy: VerifyPolicy, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        """The policy's lengths clamped to each draft [R]; a shadow row verifies its whole draft (drawn from
        the batch's own generator, never from the tokens)."""
        lengths = [min(a, b) for a, b in zip(policy(survs, limits), limits)]
        shadow = [self.shadow_fraction > 0
                  and float(torch.rand((), generator=self._shadow_gen)) < self.shadow_fraction for _ in limits]
        return [m if s else n for n, m, s in zip(lengths, limits, shadow)]

    def _verify(self, reqs: list[SpecRequest], drafts: list[Draft | None]) -> "_Verified":
        """One target forward over every row's last token and its verified drafts."""
        T = 1 + max(0 if d is None else len(d) for d in drafts)
        ids = torch.zeros(len(reqs), T, dtype=torch.long)                 # [R, T], right-padded
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            ids[i, 0] = r.tokens[-1]
            if d is not None and len(d):
                ids[i, 1:1 + len(d)] = d.tokens
        rows = [r.row for r in reqs]
        starts = [self.cache.lengths[row] for row in rows]
        taps = self._taps()
        # ragged rows are packed: the forward costs the real tokens, not rows x the longest row
        # greedy rows need only the argmax, taken once for the batch; with no sampled row the logits
        # stay in the runner dtype (the argmax of their exact fp32 upcast is the same index)
        sampled = any(not r.params.greedy for r in reqs)
        out = self.runner.forward(self.cache, ids, taps=taps, logits="all", rows=rows,
                                  lengths=[1 + (len(d) if d is not None else 0) for d in drafts], packed=True,
                                  fp32_logits=sampled)
        best = out.logits.argmax(-1) if any(r.params.greedy for r in reqs) else None    # [N] or [B, T]
        return _Verified(out, best, starts, taps)

    def _accept(self, r: SpecRequest, d: Draft | None, i: int, v: "_Verified", drafted: int,
                full_conf: list[float] | None) -> None:
        """Row ``i``: accept a prefix of its verified draft plus one target token, roll the cache back to
        it, stop on a stop token or the length limit, record the round and commit to the proposer."""
        k = 0 if d is None else len(d)
        toks = d.tokens if d is not None else torch.empty(0, dtype=torch.long)
        if r.params.greedy:
            n, nxt = greedy_accept(toks, v.out.row(v.best, i, k + 1))
        else:
            n, nxt = rejection_sample(toks, d.draft_probs if d is not None else None,
                                      token_probs(v.out.row(v.out.logits, i, k + 1), r.params), r.generator)
        self.cache.truncate(r.row, v.starts[i] + n + 1)
        new = toks[:n].tolist() + [nxt]
        stop = next((j for j, t in enumerate(new) if t in r.params.stop_token_ids), -1)
        if stop >= 0:
            new = new[:stop + 1]
            r.finish_reason = "stop"
        remaining = r.params.max_new_tokens - len(r.tokens)
        new = new[:remaining]
        if r.adapt is not None and d is not None:
            r.adapt.update(k, n)
        r.stats.observe(drafted=drafted, verified=k, accepted=min(n, len(new)), emitted=len(new),
                        full_verify=k == drafted, confidence_logits=full_conf,
                        survival=r.last_surv.tolist() if full_conf is not None and r.last_surv is not None else None)
        if r.proposer is not None:
            want = tuple(r.proposer.tap_layers)
            sel = (select_taps(v.out.row(v.out.taps, i, n + 1), v.taps, want, self.runner.arch.hidden_size)
                   if want else None)
            r.proposer.commit(r.state, [r.tokens[-1]] + toks[:n].tolist(), sel)
        r.tokens.extend(new)
        if r.finish_reason is None and len(r.tokens) >= r.params.max_new_tokens:
            r.finish_reason = "length"


@dataclass
class _Verified:
    """One step's verify forward, as every row's acceptance reads it."""

    out: ForwardOutput
    best: torch.Tensor | None      # argmax of the logits, [N] packed or [B, T]; None with no greedy row
    starts: list[int]              # each row's cache length before the step (its rollback base)
    taps: tuple[int, ...]          # the tapped layers ``out.taps`` holds


def run_requests(runner: TargetRunner, requests: list[SpecRequest], policy: VerifyPolicy, max_batch: int = 8,
                 on_finish: Callable[[SpecRequest], None] | None = None,
                 shadow_fraction: float = 0.0,
                 on_step: Callable[[int, int, float], None] | None = None) -> list[SpecRequest]:
    """Continuous batching: up to ``max_batch`` requests run together; finished ones leave and waiting
    ones join between steps. Returns the requests in finish order. Every step is reported to
    ``policy.observe(rows, tokens, seconds)`` (a live gate learns from it) and to ``on_step`` (joins and
    departures are outside the step). The policy keeps any per-request state for the whole run (no
    ``forget``), so a key reused by a later request picks up where the earlier one left off."""
    check_policy(policy)
    waiting = list(requests)[::-1]
    batch = SpecBatch(runner, shadow_fraction=shadow_fraction)
    done: list[SpecRequest] = []
    while waiting or batch.active:
        while waiting and len(batch.active) < max_batch:
            batch.add(waiting.pop())
        rows, before, t0 = len(batch.active), sum(len(r.tokens) for r in batch.active), time.perf_counter()
        batch.step(policy)
        made, dt = sum(len(r.tokens) for r in batch.active) - before, time.perf_counter() - t0
        policy.observe(rows, made, dt)
        if on_step is not None:
            on_step(rows, made, dt)
        for r in batch.remove_finished():
            done.append(r)
            if on_finish:
                on_finish(r)
    return done

"""Verify-length policies: pure functions from confidences (and a throughput curve) to lengths.

``causal_greedy`` is DSpark's Algorithm 1 with the early stop, which keeps speculative sampling exact:
a draft token's admission never depends on confidences that were computed from that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core.engine.policy import LengthRule, PolicyDefaults


@dataclass(frozen=True)
class SPSTable:
    """Engine steps per second for a verify batch of B tokens (B = 1..max), monotone non-increasing."""

    sps: tuple[float, ...]           # sps[B - 1]

    def __post_init__(self):
        if not self.sps or any(s <= 0 for s in self.sps):
            raise ValueError("an SPS table needs positive steps/s for B = 1..max")

    def __call__(self, B: int) -> float:
        if B < 1:
            raise ValueError(f"verify batch must hold at least 1 token, got {B}")
        if B <= len(self.sps):
            return self.sps[B - 1]
        # beyond the profiled range: step time grows by the table's mean per-token increment
        first, last, n = self.sps[0], self.sps[-1], len(self.sps)
        slope = (1 / last - 1 / first) / (n - 1) if n > 1 else 0.0
        return 1 / (1 / last + (B - n) * max(slope, 1e-9 / last))

    @classmethod
    def monotone(cls, measured: list[float]) -> "SPSTable":
        """Force non-increasing: a larger batch is never faster than a smaller one."""
        out, cur = [], float("inf")
        for s in measured:
            cur = min(cur, s)
            out.append(cur)
        return cls(tuple(out))


def _isotonic_increasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a noisy profile point neither drags its
    neighbours up (a running max would) nor is ignored."""
    blocks: list[list[float]] = []                 # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * c)
    return out


@dataclass(frozen=True)
class StepCost:
    """A speculative step's time in two parts, profiled apart at ``rows`` rows: the drafting pass of n rows
    (full blocks), ``draft[n - 1]`` seconds, and the verify forward of B tokens, ``forward[B - 1]`` seconds.

    One SPS(B) curve cannot tell them apart: profiled with drafts spread over the rows, its B = R + 1 ..
    2R points add a drafting row per token, so read after the drafts of a few rows are made it prices each
    further verified token as one more row's drafting pass, many times a token's forward cost, and the
    policy verifies too little. Split, the policy weighs a row's drafting pass once, when it decides who
    drafts, and each verified token at its forward cost."""

    rows: int
    forward: tuple[float, ...]       # seconds of a verify forward of B = 1.. tokens (B < rows: copies B = rows)
    draft: tuple[float, ...]         # seconds of a drafting pass for n = 1..rows rows

    def __post_init__(self):
        if self.rows < 1 or len(self.forward) < self.rows or not self.draft:
            raise ValueError("a step cost needs rows >= 1, forward times up to B >= rows and drafting times")
        if any(t <= 0 for t in self.forward) or any(t < 0 for t in self.draft):
            raise ValueError("step cost times must be positive")

    @classmethod
    def from_profile(cls, profile: dict) -> "StepCost | None":
        """From :func:`~dspark_core.scheduling.sps.profile_sps` output (None for a profile without the split, or
        without drafting)."""
        fwd, dr, rows = profile.get("forward_seconds"), profile.get("draft_seconds"), profile.get("rows")
        if not fwd or not dr or not rows or not any(dr):
            return None
        R = int(rows)
        fwd = _isotonic_increasing([float(t) for t in fwd])
        # B = R + n drafts n rows (n = 1..R); past 2R every row drafts: those points all measure n = R
        per_n = [float(t) for t in dr[R:2 * R]]
        tail = [float(t) for t in dr[2 * R:]]
        if tail and len(per_n) == R:
            per_n[-1] = sorted(tail + [per_n[-1]])[len(tail) // 2]
        return cls(R, tuple(fwd), tuple(_isotonic_increasing(per_n)))

    def forward_s(self, B: int) -> float:
        n = len(self.forward)
        if B <= n:
            return self.forward[max(B, self.rows) - 1]
        slope = (self.forward[-1] - self.forward[self.rows - 1]) / max(1, n - self.rows)
        return self.forward[-1] + (B - n) * max(slope, 0.0)

    def draft_s(self, n: int) -> float:
        if n <= 0:
            return 0.0
        m = len(self.draft)
        if n <= m:
            return self.draft[n - 1]
        return self.draft[-1] * n / m

    def shifted(self, R: int) -> "StepCost":
        """The cost of a step of R <= rows rows: the forward as if the missing rows were there (more rows
        never cost less), drafting of up to R rows unchanged."""
        if R >= self.rows:
            return self
        shift = self.rows - R
        fwd = tuple(self.forward_s(b + shift) for b in range(1, len(self.forward) + 1))
        return StepCost(R, fwd, self.draft[:R])

    def table(self, drafting_rows: int, max_tokens: int, row_overhead: float = 0.0) -> SPSTable:
        """SPS(B) for a step whose drafting pass served ``drafting_rows`` rows (already paid)."""
        d = self.draft_s(drafting_rows) + row_overhead * drafting_rows
        return SPSTable(tuple(1.0 / (d + self.forward_s(b)) for b in range(1, max_tokens + 1)))

    def best_drafters(self, R: int, surv: list[list[float]], joining: int = 0, row_overhead: float = 0.0) -> int:
        """How many of the rows in ``surv`` (sorted, most valuable first) should draft in a step of R rows:
        the n maximising tokens per second, n = 0 (a plain step) included. ``joining`` rows without
        history draft whenever the step drafts (their pass is counted, not their tokens).
        ``row_overhead``: seconds a speculative step costs per drafting row beyond the profiled drafting
        pass and verify forward (see :meth:`ScheduledPolicy.observe`)."""
        best_n, best = 0, R / self.forward_s(R)
        for n in range(1, len(surv) + 1):
            cand = sorted(a for row in surv[:n] for a in row if a > 0)[::-1]
            d = self.draft_s(n + joining) + row_overhead * (n + joining)
            tau, B, theta = float(R), R, R / (d + self.forward_s(R))
            for a in cand:                      # the whole path (previous rounds' survival: no early stop)
                B += 1
                tau += a
                theta = max(theta, tau / (d + self.forward_s(B)))
            if theta > best:
                best, best_n = theta, n
        return best_n


def survival_from_probs(step_probs: torch.Tensor) -> torch.Tensor:
    """Per-step acceptance probabilities [R, G] -> prefix survival a[r, j] = prod_{i<=j} c[r, i]."""
    return torch.cumprod(step_probs.float(), dim=-1)


def causal_greedy(surv: torch.Tensor, sps: SPSTable, other_tokens: int = 0) -> list[int]:
    """DSpark's causal greedy with early stop (paper Algorithm 1).

    surv [R, G]: non-increasing survival per request. Candidates (r, j) are visited in descending a
    (ties: smaller j first); each extends request r to j, B += 1, tau += a[r, j]; the walk stops the
    first time Theta = tau * SPS(B) fails to improve. Returns the verify length of each request.
    ``other_tokens``: tokens the step makes anyway in rows outside ``surv`` (their anchors), counted in
    tau (``sps`` already counts them in B): without them, in a step of 16 rows of which one drafts, that
    row's drafts would be weighed against 1 token instead of 16, and too many verified.
    """
    R, G = surv.shape
    lengths = [0] * R
    if R == 0:
        return lengths
    flat = [(-float(surv[r, j]), j, r) for r in range(R) for j in range(G) if float(surv[r, j]) > 0]
    flat.sort()
    B, tau = R, float(R + other_tokens)
    best = tau * sps(B)
    for neg_a, j, r in flat:
        if j != lengths[r]:            # cannot happen for a non-increasing row; guards bad input
            raise ValueError("survival rows must be non-increasing so that prefixes are admitted in order")
        B += 1
        tau += -neg_a
        theta = tau * sps(B)
        if theta > best:
            best = theta
            lengths[r] = j + 1
        else:
            break                      # early stop: later items may depend on tokens not yet admitted
    return lengths


def global_search_capacity(surv: torch.Tensor, sps: SPSTable) -> int:
    """Token budget K (draft tokens across the batch) maximising tau * SPS along the greedy path, searched
    over the whole path without early stop. Not lossless if applied to the same step's tokens; DSpark's
    production scheduler uses it on confidences from two steps earlier to size the batch."""
    R = surv.shape[0]
    vals = sorted((float(v) for v in surv.flatten() if float(v) > 0), reverse=True)
    best_k, best, tau = 0, R * sps(R), float(R)
    for k, a in enumerate(vals, 1):
        tau += a
        theta = tau * sps(R + k)
        if theta > best:
            best, best_k = theta, k
    return best_k


def top_k_lengths(surv: torch.Tensor, budget: int) -> list[int]:
    """Admit the ``budget`` highest-survival draft tokens (prefix-consistent); a fixed budget chosen
    without looking at this step's tokens keeps sampling exact."""
    R, G = surv.shape
    flat = sorted(((-float(surv[r, j]), j, r) for r in range(R) for j in range(G)))
    lengths = [0] * R
    for neg_a, j, r in flat[:max(0, budget)]:
        if j == lengths[r]:
            lengths[r] = j + 1
    return lengths


def fixed_lengths(R: int, G: int, k: int) -> list[int]:
    """Every request verifies min(k, G) draft tokens."""
    return [max(0, min(k, G))] * R


def threshold_lengths(step_probs: torch.Tensor, threshold: float) -> list[int]:
    """DeepSpec's static rule: verify the prefix before the first position whose per-step confidence is
    below ``threshold`` (per-step, not cumulative; c_k depends on x_{k-1}, never on x_k)."""
    out = []
    for row in step_probs.float().tolist():
        n = 0
        for c in row:
            if c < threshold:
                break
            n += 1
        out.append(n)
    return out


def scheduled_lengths(survs: list[torch.Tensor | None], limits: list[int], sps: SPSTable, k: int,
                      drafting_in_table: bool = True) -> list[int]:
    """Causal greedy on each row's survival [G_r] against SPS(B); rows without confidences verify
    min(k, their draft) and count in B. See :func:`make_policy` for ``drafting_in_table``."""
    fixed = [i for i, s in enumerate(survs) if s is None]
    conf = [i for i, s in enumerate(survs) if s is not None]
    out = [min(k, limits[i]) for i in range(len(limits))]
    if not conf:
        return out
    G = max(len(survs[i]) for i in conf)
    mat = torch.zeros(len(conf), G)                       # [rows with confidences, G], zero-padded
    for j, i in enumerate(conf):
        mat[j, :len(survs[i])] = survs[i]
    extra = sum(1 + out[i] for i in fixed)                # fixed-length rows' tokens are in B too
    # The drafts already ran: their cost is paid whatever is verified now. SPS(B) profiles the
    # drafting pass from B = R + 1 on, so verifying nothing cannot be faster than SPS(R + 1).
    paid = sps(len(limits) + 1) if drafting_in_table else float("inf")
    shifted = SPSTable(tuple(min(sps(b + extra), paid) for b in range(1, len(conf) * (G + 1) + 1)))
    # causal_greedy starts from B = number of confidence rows (their anchors)
    for j, ell in zip(conf, causal_greedy(mat, shifted, other_tokens=len(fixed))):
        out[j] = ell
    return out


def _threshold_rule(survs: list[torch.Tensor | None], limits: list[int], k: int, threshold: float) -> list[int]:
    out = []
    for s, m in zip(survs, limits):
        if s is None:
            out.append(min(k, m))
            continue
        step = torch.cat([s[:1], s[1:] / s[:-1].clamp_min(1e-12)])      # survival back to per-step [G]
        out.append(threshold_lengths(step[None], threshold)[0])
    return out


def make_policy(name: str, sps: SPSTable | None = None, k: int = 7, threshold: float = 0.5,
                drafting_in_table: bool = True) -> LengthRule:
    """A verify-length policy for :class:`~dspark_core.engine.spec_batch.SpecBatch` (every row drafts).

    ``fixed``: every request verifies min(k, its draft). ``threshold``: DeepSpec's per-step rule on the
    confidences (requests without confidences verify k). ``scheduled``: causal greedy on survival and
    SPS(B) (requests without confidences verify k, counted in B). ``drafting_in_table``: the table is a
    profiled SPS(B) whose drafting jump sits at B = R + 1 (the drafts are made, so verifying nothing is
    priced as SPS(R + 1)); False for a table whose every entry already holds this step's drafting pass
    (:meth:`StepCost.table`).
    """
    if name == "fixed":
        return LengthRule("fixed", lambda survs, limits: [min(k, m) for m in limits])
    if name == "threshold":
        return LengthRule("threshold", lambda survs, limits: _threshold_rule(survs, limits, k, threshold))
    if name == "scheduled":
        if sps is None:
            raise ValueError("the scheduled policy needs an SPS(B) table (dspark profile-sps)")
        return LengthRule("scheduled", lambda survs, limits: scheduled_lengths(survs, limits, sps, k,
                                                                               drafting_in_table))
    raise ValueError(f"unknown policy {name!r}; choose fixed, threshold or scheduled")


class ScheduledPolicy(PolicyDefaults):
    """DSpark's load-aware policy for a continuous batch, with SPS(B) tables per concurrency.

    Two decisions, both non-anticipating (so sampling stays exact):

    - ``plan`` (before drafting): which requests draft at all this step. The budget K comes from a
      global search over each request's survival from its *previous* round (the production scheduler's
      "two steps earlier" idea; the latest round only, since a running mean over a request's rounds
      drafts more and serves slower); a request drafts only if it holds one of the top-K items. A request
      with no history drafts when the step drafts anyway (or when no request has history), one skipped
      ``explore_every`` rounds in a row drafts anyway so its estimate stays fresh, and with it every row
      past half of that (a new one starts half-way): a drafting pass is a fixed cost per step, so forced
      drafts gather into few steps instead of one staggered join or stale row paying it every step.
      Drafting costs time even when nothing is verified, so under load this is what keeps speculation
      from falling below plain decoding.
    - ``__call__`` (after drafting): Algorithm 1's causal greedy with early stop on the current
      calibrated survival, B counting every request's anchor.

    With split step costs, the engine's own work per drafting row (accepting or rejecting its drafts,
    advancing the drafter over the accepted tokens, bookkeeping), which the offline profile of the
    drafting pass and the verify forward does not time, is measured live: ``observe`` compares each
    step's seconds with the profile's prediction and keeps an average of the excess per drafting row
    (beyond that of plain steps), which both decisions then add to a drafting row's cost. Measured on
    a 2-core CPU at 4 rows it was about 1.6 ms per drafting row, a sixth of a speculative step, and
    without it the policy drafted at 8 rows where plain steps were faster.
    """

    OVERHEAD_ALPHA = 0.05              # weight of each step in the measured overhead's running average

    def __init__(self, tables: dict[int, SPSTable], k: int, explore_every: int = 8,
                 costs: dict[int, StepCost] | None = None, learn_overhead: bool = True):
        if not tables:
            raise ValueError("the scheduled policy needs at least one SPS(B) table")
        self.tables, self.k, self.explore_every = dict(sorted(tables.items())), k, explore_every
        self.costs = dict(sorted((costs or {}).items()))
        self._skipped: dict[object, int] = {}
        self._shifted: dict[int, SPSTable] = {}
        self._cost_at: dict[int, StepCost] = {}
        self._cost_tables: dict[tuple[int, int, int], SPSTable] = {}
        self.learn_overhead = learn_overhead
        self.row_overhead = 0.0            # measured seconds per drafting row beyond the profile
        self._plain_excess = 0.0           # measured seconds of a plain step beyond the profile
        self._overhead_steps = 0
        self._last: list | None = None     # this step's [rows, drafting rows, verify tokens]

    def cost(self, R: int) -> StepCost | None:
        """The split step cost (see :class:`StepCost`) for R rows, from the one profiled at the smallest
        concurrency >= R (else the largest); None without split profiles (then SPS(B) alone decides)."""
        if not self.costs:
            return None
        if R not in self._cost_at:
            c = next((c for rows, c in self.costs.items() if rows >= R), list(self.costs.values())[-1])
            self._cost_at[R] = c.shifted(R)
        return self._cost_at[R]

    def table(self, R: int) -> SPSTable:
        """SPS(B) for a step of R rows, from the table profiled at the smallest concurrency >= R (else
        the largest), shifted so that its drafting jump lands at B = R + 1: a table profiled at 16 rows
        is flat up to B = 16 (no drafting) and only drops at 17, so read as is for 15 rows it would show
        a drafting pass that serves one row as free."""
        if R not in self._shifted:
            profiled, t = next(((rows, t) for rows, t in self.tables.items() if rows >= R),
                               list(self.tables.items())[-1])
            shift = profiled - R
            self._shifted[R] = t if shift == 0 else SPSTable(tuple(t(max(1, b + shift))
                                                                   for b in range(1, len(t.sps) + 1)))
        return self._shifted[R]

    def plan(self, keys: list, prev_survs: list[torch.Tensor | None]) -> list[bool]:
        """Which rows draft this step (see the class docstring), from each row's previous survival [G_r]."""
        R = len(keys)
        table = self.table(R)
        cost = self.cost(R)
        known = [i for i, s in enumerate(prev_survs) if s is not None]
        if not known:                                 # nothing known yet (a lone new request): draft
            draft = [True] * R
        elif cost is not None:
            # split cost: rows ranked by the tokens their last draft was expected to add; the top n draft,
            # n (0 = a plain step) maximising tokens per second with each drafting row's pass counted once
            rows = sorted(((prev_survs[i].tolist(), i) for i in known), key=lambda x: -sum(x[0]))
            n = cost.best_drafters(R, [r for r, _ in rows], joining=R - len(known), row_overhead=self.row_overhead)
            draft = [False] * R
            for _, i in rows[:n]:
                draft[i] = True
            if n:                                     # the drafting pass runs: rows without history join it
                draft = [d or prev_survs[i] is None for i, d in enumerate(draft)]
        else:
            draft = [False] * R
            G = max(len(prev_survs[i]) for i in known)
            mat = torch.zeros(len(known), G)
            for j, i in enumerate(known):
                mat[j, :len(prev_survs[i])] = prev_survs[i]
            unknown = R - len(known)                  # their anchors are in B (they draft only if the step does)
            shifted = SPSTable(tuple(table(b + unknown) for b in range(1, len(known) * (G + 1) + 1)))
            budget = global_search_capacity(mat, shifted)
            for j, n in zip(known, top_k_lengths(mat, budget)):
                draft[j] = n > 0
            if any(draft):                            # the drafting pass is paid: new rows join it
                draft = [d or prev_survs[i] is None for i, d in enumerate(draft)]
        # a row that has not drafted for a while (or never: it starts half-way there) is due for a fresh
        # estimate; a drafting pass is a fixed cost per step whatever the rows it serves, so when one row
        # is due every row past half-way joins it: forced drafts gather into few steps
        half = self.explore_every // 2
        skipped = [0 if draft[i] else self._skipped.get(key, half if prev_survs[i] is None else 0) + 1
                   for i, key in enumerate(keys)]
        if any(n >= self.explore_every for n in skipped):
            for i, n in enumerate(skipped):
                if n >= half:
                    draft[i], skipped[i] = True, 0
        for key, n in zip(keys, skipped):
            self._skipped[key] = n
        self._last = [R, sum(draft), R]
        return draft

    def note_plain(self, rows: int) -> None:
        """A step of ``rows`` rows runs without drafting by another's decision (a live gate's plain arm)."""
        self._last = [rows, 0, rows]

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """The step just run took ``seconds``: update the measured overhead (class docstring)."""
        last, self._last = self._last, None
        cost = self.cost(rows) if last is not None and last[0] == rows and self.learn_overhead else None
        if cost is None or seconds <= 0:
            return
        R, n, B = last
        predicted_plain = cost.forward_s(R)
        if n == 0:
            excess = min(seconds - predicted_plain, predicted_plain)        # a descheduled step is one spike
            self._plain_excess += self.OVERHEAD_ALPHA * (excess - self._plain_excess)
            return
        excess = seconds - cost.draft_s(n) - cost.forward_s(B) - self._plain_excess
        per_row = min(max(excess, 0.0) / n, predicted_plain)
        self._overhead_steps += 1
        self.row_overhead += self.OVERHEAD_ALPHA * (per_row - self.row_overhead)

    def describe(self) -> dict | None:
        return {"row_overhead_ms": round(1000 * self.row_overhead, 3),
                "plain_excess_ms": round(1000 * self._plain_excess, 3), "overhead_steps": self._overhead_steps}

    def forget(self, key) -> None:
        """Drop a finished request's skip counter (long-running engines call it as requests leave)."""
        self._skipped.pop(key, None)

    def __call__(self, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        R = len(limits)
        cost = self.cost(R)
        if cost is None:
            out = scheduled_lengths(survs, limits, self.table(R), self.k)
        else:
            # the drafting pass is paid: each further verified token costs its forward time only
            n = sum(1 for m in limits if m > 0)
            key = (R, n, round(self.row_overhead * 1e4))                 # 0.1 ms steps of the overhead
            if key not in self._cost_tables:
                if len(self._cost_tables) > 4096:
                    self._cost_tables.clear()
                self._cost_tables[key] = cost.table(n, R * (self.k + 1) + 1, self.row_overhead)
            out = scheduled_lengths(survs, limits, self._cost_tables[key], self.k, drafting_in_table=False)
        if self._last is not None:
            self._last[2] = R + sum(out)
        return out

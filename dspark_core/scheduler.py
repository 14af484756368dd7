"""Verify-length policies: pure functions from confidences (and a throughput curve) to lengths.

``causal_greedy`` is DSpark's Algorithm 1 with the early stop, which keeps speculative sampling exact:
a draft token's admission never depends on confidences that were computed from that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def survival_from_probs(step_probs: torch.Tensor) -> torch.Tensor:
    """Per-step acceptance probabilities [R, G] -> prefix survival a[r, j] = prod_{i<=j} c[r, i]."""
    return torch.cumprod(step_probs.float(), dim=-1)


def causal_greedy(surv: torch.Tensor, sps: SPSTable) -> list[int]:
    """DSpark's causal greedy with early stop (paper Algorithm 1).

    surv [R, G]: non-increasing survival per request. Candidates (r, j) are visited in descending a
    (ties: smaller j first); each extends request r to j, B += 1, tau += a[r, j]; the walk stops the
    first time Theta = tau * SPS(B) fails to improve. Returns the verify length of each request.
    """
    R, G = surv.shape
    lengths = [0] * R
    if R == 0:
        return lengths
    flat = [(-float(surv[r, j]), j, r) for r in range(R) for j in range(G) if float(surv[r, j]) > 0]
    flat.sort()
    B, tau = R, float(R)
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


def make_policy(name: str, sps: SPSTable | None = None, k: int = 7, threshold: float = 0.5):
    """A verify-length policy for :class:`~dspark_core.spec_batch.SpecBatch`.

    ``fixed``: every request verifies min(k, its draft). ``threshold``: DeepSpec's per-step rule on the
    confidences (requests without confidences verify k). ``scheduled``: causal greedy on survival and
    SPS(B) (requests without confidences verify k, counted in B).
    """
    if name == "fixed":
        return lambda survs, limits: [min(k, m) for m in limits]
    if name == "threshold":
        def _thr(survs, limits):
            out = []
            for s, m in zip(survs, limits):
                if s is None:
                    out.append(min(k, m))
                    continue
                step = torch.cat([s[:1], s[1:] / s[:-1].clamp_min(1e-12)])
                out.append(threshold_lengths(step[None], threshold)[0])
            return out
        return _thr
    if name == "scheduled":
        if sps is None:
            raise ValueError("the scheduled policy needs an SPS(B) table (dspark profile-sps)")

        def _sched(survs, limits):
            fixed = [i for i, s in enumerate(survs) if s is None]
            conf = [i for i, s in enumerate(survs) if s is not None]
            out = [min(k, limits[i]) for i in range(len(limits))]
            if not conf:
                return out
            G = max(len(survs[i]) for i in conf)
            mat = torch.zeros(len(conf), G)
            for j, i in enumerate(conf):
                mat[j, :len(survs[i])] = survs[i]
            extra = sum(1 + out[i] for i in fixed)        # fixed-length rows' tokens are in B too
            # The drafts already ran: their cost is paid whatever is verified now. SPS(B) profiles the
            # drafting pass from B = R + 1 on, so verifying nothing cannot be faster than SPS(R + 1).
            paid = sps(len(limits) + 1)
            shifted = SPSTable(tuple(min(sps(b + extra), paid) for b in range(1, len(conf) * (G + 1) + 1)))
            # causal_greedy starts from B = number of confidence rows (their anchors)
            for j, ell in zip(conf, causal_greedy(mat, shifted)):
                out[j] = ell
            return out
        return _sched
    raise ValueError(f"unknown policy {name!r}; choose fixed, threshold or scheduled")


class ScheduledPolicy:
    """DSpark's load-aware policy for a continuous batch, with SPS(B) tables per concurrency.

    Two decisions, both non-anticipating (so sampling stays exact):

    - ``plan`` (before drafting): which requests draft at all this step. The budget K comes from a
      global search over each request's survival from its *previous* round (the production scheduler's
      "two steps earlier" idea); a request drafts only if it holds one of the top-K items. A request
      with no history, or one skipped ``explore_every`` rounds in a row, drafts anyway so its estimate
      stays fresh. Drafting costs time even when nothing is verified, so under load this is what keeps
      speculation from falling below plain decoding.
    - ``__call__`` (after drafting): Algorithm 1's causal greedy with early stop on the current
      calibrated survival, B counting every request's anchor.
    """

    def __init__(self, tables: dict[int, SPSTable], k: int, explore_every: int = 8):
        if not tables:
            raise ValueError("the scheduled policy needs at least one SPS(B) table")
        self.tables, self.k, self.explore_every = dict(sorted(tables.items())), k, explore_every
        self._skipped: dict[object, int] = {}

    def table(self, R: int) -> SPSTable:
        """The table profiled at the smallest concurrency >= R (else the largest)."""
        for rows, t in self.tables.items():
            if rows >= R:
                return t
        return list(self.tables.values())[-1]

    def plan(self, keys: list, prev_survs: list[torch.Tensor | None]) -> list[bool]:
        R = len(keys)
        table = self.table(R)
        known = [i for i, s in enumerate(prev_survs) if s is not None]
        draft = [s is None for s in prev_survs]
        if known:
            G = max(len(prev_survs[i]) for i in known)
            mat = torch.zeros(len(known), G)
            for j, i in enumerate(known):
                mat[j, :len(prev_survs[i])] = prev_survs[i]
            unknown = R - len(known)                  # they draft and verify up to k: count them in B
            shifted = SPSTable(tuple(table(b + unknown * (1 + self.k)) for b in range(1, len(known) * (G + 1) + 1)))
            budget = global_search_capacity(mat, shifted)
            for j, n in zip(known, top_k_lengths(mat, budget)):
                draft[j] = n > 0
        for i, key in enumerate(keys):
            if draft[i]:
                self._skipped[key] = 0
            else:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                if self._skipped[key] >= self.explore_every:
                    draft[i] = True
                    self._skipped[key] = 0
        return draft

    def forget(self, key) -> None:
        """Drop a finished request's skip counter (long-running engines call it as requests leave)."""
        self._skipped.pop(key, None)

    def __call__(self, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        return make_policy("scheduled", self.table(len(limits)), k=self.k)(survs, limits)


class LiveGate:
    """Speculate at all this step? Decided from live throughput, per concurrency bucket (1, 2, 4, 8, ...).

    An offline SPS(B) table misses costs the engine pays (a batched drafting pass is a fixed cost per
    step, plus Python and, in a server, HTTP work), so under load the scheduler can draft where plain
    decoding would be faster. Per bucket the gate runs one arm, speculation (the wrapped scheduler
    decides who drafts and how much) or plain steps without any drafting, and now and then explores the
    other. It compares the arms by the *ratio of their tokens per second* measured close in time: each
    explored step's rate against the running arm's recent exponential average (and the first
    ``min_samples`` steps of each arm against each other), averaged over explorations. A shared machine
    whose speed drifts slows both sides of a pair alike, so a slow spell cannot make the arm that
    happened to run through it look worse and lock the other in. The faster arm runs (``margin`` > 0
    would let speculation keep a near-tie; by default none: at a fixed number of rows, per-user speed is
    throughput / rows, so a near-tie in throughput is a near-tie for users too). Explorations come after
    ``explore_every`` steps and back off while they keep confirming a clear winner (the interval doubles
    each time the gap is past 10 %, up to x16; back to ``explore_every`` on a near-tie), so drafting is
    not paid for again and again where it plainly does not pay (a request's first draft also absorbs
    its whole context). It decides from finished steps only, never from this step's drafts, so sampling
    stays exact. The engine reports each step through ``observe(rows, tokens emitted, seconds)``.
    """

    MAX_BACKOFF = 4

    def __init__(self, inner, explore_every: int = 16, min_samples: int = 4, alpha: float = 0.1,
                 margin: float = 0.0, pair_alpha: float = 0.3):
        self.inner, self.explore_every, self.min_samples, self.alpha = inner, explore_every, min_samples, alpha
        self.margin, self.pair_alpha = margin, pair_alpha
        self.stats: dict[int, dict[str, list[float]]] = {}    # bucket -> arm -> [ema tokens, ema seconds, n]
        self.steps: dict[int, int] = {}
        self.explore: dict[int, list[int]] = {}                # bucket -> [next exploring step, backoff]
        self.ratio: dict[int, float] = {}                      # bucket -> EMA of spec rate / plain rate
        self.running: dict[int, str] = {}                      # bucket -> the arm it runs between explorations
        self.last_arm: str | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _arms(self, rows: int) -> dict[str, list[float]]:
        return self.stats.setdefault(self.bucket(rows), {"spec": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]})

    @staticmethod
    def _rate(st: list[float]) -> float:
        return st[0] / st[1] if st[1] > 0 else 0.0

    def _best(self, b: int) -> str:
        return "spec" if self.ratio.get(b, 1.0) * (1 + self.margin) >= 1.0 else "plain"

    def choose(self, rows: int) -> str:
        b, st = self.bucket(rows), self._arms(rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        for arm in ("spec", "plain"):
            if st[arm][2] < self.min_samples:
                return arm
        if b not in self.ratio:                          # first estimate: the two warm-up samples
            self.ratio[b] = max(self._rate(st["spec"]), 1e-9) / max(self._rate(st["plain"]), 1e-9)
        best = self.running[b] = self._best(b)
        other = "plain" if best == "spec" else "spec"
        ex = self.explore.setdefault(b, [self.explore_every, 0])
        if n < ex[0]:
            return best
        gap = max(self.ratio[b], 1 / self.ratio[b]) - 1
        ex[1] = min(ex[1] + 1, self.MAX_BACKOFF) if gap > 0.10 else 0
        ex[0] = n + self.explore_every * (1 << ex[1])
        return other

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if self.last_arm is None or seconds <= 0:
            return
        b, arm = self.bucket(rows), self.last_arm
        st = self._arms(rows)[arm]
        running = self.running.get(b)
        if running is not None and arm != running and b in self.ratio:
            ref = self._rate(self._arms(rows)[running])   # the running arm's recent average: a close-in-time pair
            if ref > 0 and tokens > 0:
                rate = tokens / seconds
                pair = rate / ref if arm == "spec" else ref / rate
                self.ratio[b] = max(1e-3, (1 - self.pair_alpha) * self.ratio[b] + self.pair_alpha * pair)
        if st[2] == 0:
            st[0], st[1] = float(tokens), seconds
        else:
            st[0] = (1 - self.alpha) * st[0] + self.alpha * tokens
            st[1] = (1 - self.alpha) * st[1] + self.alpha * seconds
        st[2] += 1
        self.last_arm = None

    def plan(self, keys: list, prev_survs: list) -> list[bool]:
        self.last_arm = self.choose(len(keys))
        if self.last_arm == "plain":
            return [False] * len(keys)
        inner_plan = getattr(self.inner, "plan", None)
        return inner_plan(keys, prev_survs) if inner_plan else [True] * len(keys)

    def __call__(self, survs, limits):
        return self.inner(survs, limits)

    def table(self, rows: int):
        return self.inner.table(rows)

    def forget(self, key) -> None:
        """Drop a finished request's per-request scheduler state."""
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            forget(key)

    def describe(self) -> dict:
        return {str(b): {**{a: {"tok_s": round(self._rate(v), 2), "steps": int(v[2])} for a, v in st.items()},
                         "spec_vs_plain": round(self.ratio[b], 3) if b in self.ratio else None}
                for b, st in sorted(self.stats.items())}

"""The verify-length policy the engine runs: scheduled (load-aware, SPS(B) per concurrency), fixed, none.

SPS(B) tables come, in this order, from ``--sps`` (a ``dspark profile-sps`` JSON, or
``{"tables": {"<rows>": profile, ...}}`` for one table per concurrency), from the ``sps.json`` registered
with a loaded drafter, or from a short profile at start-up (one row, the drafter's block).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dspark_core.scheduler import ScheduledPolicy, SPSTable, make_policy
from dspark_core.sps import profile_sps

log = logging.getLogger("dspark.serving.policy")
FIXED_ALL = 1 << 16         # "fixed": verify every drafted token


def sps_tables(obj: dict) -> dict[int, SPSTable]:
    """One profile (``{"sps": [...], "rows": R}``) or ``{"tables": {"R": profile | [sps...]}}``."""
    if "tables" in obj:
        out = {}
        for rows, prof in obj["tables"].items():
            sps = prof["sps"] if isinstance(prof, dict) else prof
            out[int(rows)] = SPSTable(tuple(float(x) for x in sps))
        return out
    if "sps" in obj:
        return {int(obj.get("rows") or 1): SPSTable(tuple(float(x) for x in obj["sps"]))}
    raise ValueError("an SPS file needs 'sps' (one profile) or 'tables' (one profile per concurrency)")


def resolve_sps(sps_path: Path | None, drafters: list, runner) -> tuple[dict[int, SPSTable], str]:
    """The tables for the scheduled policy and where they came from."""
    if sps_path is not None:
        return sps_tables(json.loads(Path(sps_path).read_text())), str(sps_path)
    for d in drafters:
        if d.sps:
            try:
                return sps_tables(d.sps), f"registry sps.json of {d.label}"
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring the SPS profile of %s: %s", d.label, e)
    prop = drafters[0].proposer if drafters else None
    block = getattr(prop, "max_block", 7)
    log.info("profiling SPS(B) at start-up (one row, B = 1..%d); pass --sps for per-concurrency tables", block + 1)
    prof = profile_sps(runner, prop, block + 1, reps=2, context=128, block=block, rows=1)
    return {1: SPSTable(tuple(prof["sps"]))}, "start-up profile (one row)"


class LiveGate:
    """Speculate at all this step? Decided from live throughput, per concurrency bucket (1, 2, 4, 8, ...).

    An offline SPS(B) table misses costs the server pays (a batched drafting pass is a fixed cost per
    step, plus Python and HTTP work), so under load the scheduler can draft where plain decoding would be
    faster. The gate keeps exponential averages of emitted tokens and of step seconds for steps with
    speculation (the wrapped scheduler decides who drafts and how much) and for steps without any
    drafting, and runs the arm with more tokens per second; plain decoding must beat speculation by
    ``margin`` to be chosen, so measurement noise does not turn speculation off where the two are close
    (speculation's point is per-user speed, which a near-tie in throughput does not show). It explores the
    other arm every ``explore_every``-th step of a bucket, less often when the gap is wide (x2 past 10 %,
    x4 past 25 %), so both estimates stay fresh. It decides from finished steps only, never from this step's drafts, so
    sampling stays exact.
    """

    def __init__(self, inner, explore_every: int = 16, min_samples: int = 4, alpha: float = 0.1,
                 margin: float = 0.05):
        self.inner, self.explore_every, self.min_samples, self.alpha = inner, explore_every, min_samples, alpha
        self.margin = margin
        self.stats: dict[int, dict[str, list[float]]] = {}    # bucket -> arm -> [ema tokens, ema seconds, n]
        self.steps: dict[int, int] = {}
        self.last_arm: str | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _arms(self, rows: int) -> dict[str, list[float]]:
        return self.stats.setdefault(self.bucket(rows), {"spec": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]})

    @staticmethod
    def _rate(st: list[float]) -> float:
        return st[0] / st[1] if st[1] > 0 else 0.0

    def choose(self, rows: int) -> str:
        b, st = self.bucket(rows), self._arms(rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        for arm in ("spec", "plain"):
            if st[arm][2] < self.min_samples:
                return arm
        rates = {a: self._rate(st[a]) for a in st}
        best = "plain" if rates["plain"] > rates["spec"] * (1 + self.margin) else "spec"
        other = "plain" if best == "spec" else "spec"
        gap = rates[best] / max(rates[other], 1e-9) - 1
        every = self.explore_every * (4 if gap > 0.25 else 2 if gap > 0.10 else 1)
        return other if n % every == 0 else best

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if self.last_arm is None or seconds <= 0:
            return
        st = self._arms(rows)[self.last_arm]
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
        return {str(b): {a: {"tok_s": round(self._rate(v), 2), "steps": int(v[2])} for a, v in st.items()}
                for b, st in sorted(self.stats.items())}


def build_policy(name: str, drafters: list, runner, sps_path: Path | None = None, live_gate: bool = True):
    """Returns (policy, sps tables, description)."""
    k = max((getattr(d.proposer, "max_block", 0) for d in drafters), default=0) or 7
    if name == "none":
        return make_policy("fixed", k=0), {}, "no speculation"
    if name == "fixed":
        return make_policy("fixed", k=FIXED_ALL), {}, "fixed: verify the whole drafted block"
    tables, where = resolve_sps(sps_path, drafters, runner)
    policy = ScheduledPolicy(tables, k=k)
    if live_gate:
        return LiveGate(policy), tables, f"scheduled, SPS(B) from {where}, live gate"
    return policy, tables, f"scheduled, SPS(B) from {where}"

"""The live gate: speculate at all this step? Decided from measured throughput per concurrency bucket."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Hashable

import torch

from dspark_core.engine.policy import LengthRule, PolicyDefaults, VerifyPolicy

# a gate without a scheduler inside: speculation verifies every drafted token
_VERIFY_ALL = LengthRule("verify-all", lambda survs, limits: list(limits))


class _GateBucket:
    """One concurrency bucket's live comparison (see ``LiveGate``)."""

    def __init__(self, window: int, history: int, running: str = "spec", inherited: bool = False):
        self.running = running                 # the arm run between explorations
        self.inherited = inherited             # started from a smaller bucket's verdict: no bracket at once
        self.phase = "run"                     # run -> explore (the other arm) -> back (the running arm) -> run
        self.recent: deque = deque(maxlen=window)   # the running arm's latest counted steps: (tokens, seconds)
        self.before: list = []
        self.explored: list = []
        self.after: list = []
        self.since = 0                         # counted steps since the last comparison ended
        self.log_ratio: float | None = None    # mean of log(spec rate / plain rate) over recent comparisons
        self.pairs: deque = deque(maxlen=history)   # those comparisons' log ratios
        self.backoff = 0
        self.seen = {"spec": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]}   # every step: tokens, seconds, steps
        self.switches = 0                      # steps that followed the other arm, kept out of comparisons
        self.switch_steps: list = []           # this bracket's switch steps (into the explored arm and back)
        self.losses: deque = deque(maxlen=history)  # recent brackets' cost, in running-arm steps (see LiveGate)
        self.budget_interval = 0               # counted steps between brackets that keeps that cost in budget

    @property
    def other(self) -> str:
        return "plain" if self.running == "spec" else "spec"


GATE_HURDLE = 0.04      # LiveGate's default lead for speculation above one row (see its docstring)
GATE_EXPLORE_BUDGET = 0.02   # LiveGate's default share of running-arm time its brackets may lose


class LiveGate(PolicyDefaults):
    """Speculate at all this step? Decided from live throughput, per concurrency bucket (1, 2, 4, 8, ...).

    An offline SPS(B) table misses costs the engine pays (a batched drafting pass is a fixed cost per
    step, plus Python and, in a server, HTTP work), so under load the scheduler can draft where plain
    decoding would be faster. Per bucket the gate runs one arm, speculation (the wrapped scheduler
    decides who drafts and how much) or plain steps without any drafting, and now and then compares it
    with the other in a bracket: ``window`` steps of the running arm, then ``window`` steps of the other,
    then ``window`` of the running arm again. The comparison is the ratio of *summed* tokens over
    *summed* seconds, the other arm's window against both running windows around it, so

    - a shared machine whose speed drifts slows both sides alike (the bracket cancels a steady drift,
      so a slow spell cannot lock in the arm that happened to run through it);
    - it is not biased by noise: the mean of single-step rates overrates an arm whose step times vary
      (the mean of 1/t exceeds 1/mean t; speculative steps vary most), and would keep speculation
      running where plain steps are faster;
    - the step after a change of arm (speculation's first step then also drafts over the tokens the
      plain steps added, and the first plain step after speculation is no different from the others,
      but both are transitions) is left out of every window, so a one-off switching cost does not
      decide which arm is faster in steady state (it is counted, in ``describe``, as ``switches``).

    The last ``history`` comparisons are averaged (the mean of their log ratios), and the faster arm
    runs, with one exception: on more than one row speculation must be ``hurdle`` faster (4 % by
    default) to run. The bracket times steps only and so misses two costs only speculation has with
    co-running rows: its switch steps (left out above) and the desynchronisation it causes (rows that
    made different numbers of tokens finish at different steps, so the batch drains part-full and
    requests join one by one). The default hurdle is sized to that optimism: the bracket's ratio against
    the ratio of whole runs, both of which the load bench (``dspark bench --suite load``) reports.
    (``margin`` > 0 lets speculation keep a near-tie; by default none: at a fixed number of rows,
    per-user speed is throughput / rows, so a near-tie in throughput is a near-tie for users too). A
    bucket starts on speculation and makes its first comparison at once (one above a smaller bucket that
    settled on plain starts on plain and waits: more rows never make speculation pay more; above one
    whose plain verdict is clear, a bucket runs speculation only on a clear verdict of its own and
    explores no more often than that one); later ones come ``explore_every`` counted steps after the
    previous one ended and back off while they keep confirming a clear winner (after three comparisons, the interval doubles each time the gap is past
    2 % by more than its standard error, up to x16; back to ``explore_every`` otherwise), so drafting is
    not paid for again and again where it does not pay (the gap is measured from the bucket's threshold:
    1.0, or 1 + ``hurdle`` above one row).

    A bracket also has a price, whatever the evidence says: the explored arm's window and the two switch
    steps around it run slower than the running arm would have (exploring speculation where plain steps
    win means a switch step that drafts over every token the plain steps added, then a window of steps
    that each take longer than a plain step). Each bracket's cost is measured, in running-arm steps: the
    seconds of its explored and switch steps minus the time the running arm would have taken for the
    same tokens. The next bracket comes no sooner than that cost (the median of the recent ones) divided
    by ``explore_budget`` (2 % of the running arm's time by default), up to ``explore_every`` x 16
    counted steps: a near-tie costs little and is checked often, a clear loser rarely, without waiting
    for three comparisons to agree (a server's load level may last only a few hundred steps, too few for
    the backoff alone to space brackets out). ``explore_budget=0`` turns the price off. A bucket above
    one that settled on plain explores no more often than that bucket does.

    It decides from finished steps only, never from this step's drafts, so sampling stays exact. The
    engine reports each step through ``observe(rows, tokens, seconds)``. ``inner`` decides who drafts and
    how much when the gate runs speculation (None: every row drafts and verifies its whole block).

    ``alt`` replaces the plain arm with another policy, so the same bracket picks between two ways to
    speculate: :func:`make_length_gate` runs the scheduler against verifying every drafted token. There the
    two arms are not ordered by load (``monotone=False``: a bucket never starts from a smaller one's
    verdict), ``labels`` names them in ``describe``, and a plain step the outer gate runs is reported
    through ``note_plain`` so the step after it counts as a switch.
    """

    MAX_BACKOFF = 4

    def __init__(self, inner: VerifyPolicy | None, explore_every: int = 48, window: int = 4, history: int = 8,
                 margin: float = 0.0, hurdle: float = GATE_HURDLE, explore_budget: float = GATE_EXPLORE_BUDGET,
                 alt: VerifyPolicy | None = None, monotone: bool = True, labels: tuple[str, str] = ("spec", "plain")):
        if window < 1 or explore_every < 1:
            raise ValueError("the live gate needs window >= 1 and explore_every >= 1")
        if not (0.0 <= hurdle < 1.0) or not (-1.0 < margin < 1.0):
            raise ValueError(f"the live gate needs 0 <= hurdle < 1 and -1 < margin < 1, got {hurdle}, {margin}")
        if not 0.0 <= explore_budget < 1.0:
            raise ValueError(f"the live gate needs 0 <= explore_budget < 1, got {explore_budget}")
        self.inner: VerifyPolicy = inner if inner is not None else _VERIFY_ALL
        self.alt, self.monotone, self.labels = alt, monotone, labels
        self.explore_every, self.window = explore_every, window
        self.history, self.margin, self.hurdle = history, margin, hurdle
        self.explore_budget = explore_budget
        self.buckets: dict[int, _GateBucket] = {}
        self.last_arm: str | None = None          # the arm of the step being run (None once observed)
        self._last_bucket: int | None = None
        self._prev_arm: str | None = None         # the arm of the last finished step, any bucket

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _state(self, b: int) -> _GateBucket:
        if b not in self.buckets:
            # more rows never make speculation pay more (its drafting and verifying compete with more
            # rows' plain tokens), so a new bucket above one that has settled on plain starts on plain
            # and compares after explore_every steps, not at once
            below = [st for k, st in sorted(self.buckets.items()) if k < b and st.log_ratio is not None]
            plain_below = self.monotone and bool(below) and below[-1].running == "plain"
            self.buckets[b] = _GateBucket(self.window, self.history, running="plain" if plain_below else "spec",
                                          inherited=plain_below)
        return self.buckets[b]

    def ratio(self, b: int) -> float | None:
        """Speculation's throughput over plain decoding's at bucket ``b`` (None before a comparison)."""
        st = self.buckets.get(b)
        return None if st is None or st.log_ratio is None else math.exp(st.log_ratio)

    def _clear_plain_below(self, b: int) -> int:
        """The largest backoff of a smaller bucket that runs plain on a clear verdict (0 if none)."""
        if not self.monotone:
            return 0
        return max((st.backoff for k, st in self.buckets.items() if k < b and st.running == "plain"),
                   default=0)

    def _budget_below(self, b: int) -> int:
        """The longest budget interval of a smaller bucket that runs plain after a comparison (0 if none)."""
        if not self.monotone:
            return 0
        return max((st.budget_interval for k, st in self.buckets.items()
                    if k < b and st.running == "plain" and st.log_ratio is not None), default=0)

    def interval(self, b: int) -> int:
        """Counted steps of the running arm between bucket ``b``'s brackets, as things stand."""
        st = self._state(b)
        due = self.explore_every << max(st.backoff, self._clear_plain_below(b))
        return min(max(due, st.budget_interval, self._budget_below(b)), self.explore_every << self.MAX_BACKOFF)

    def choose(self, rows: int) -> str:
        b = self.bucket(rows)
        st = self._state(b)
        # More rows never make speculation pay more. Once a smaller bucket has clearly settled on plain
        # steps (its backoff is on), this one needs its own clear verdict to run speculation (a near-tie
        # runs plain: an estimate hovering around 1 would keep running speculative steps where, at the
        # larger load, they are the slower ones) and explores no more often than that bucket.
        floor = self._clear_plain_below(b)
        if floor and st.phase == "run" and st.running == "spec" and st.backoff == 0:
            st.running, st.since = "plain", 0
            st.recent.clear()
        if st.phase == "run":
            first = st.log_ratio is None and not st.inherited
            if len(st.recent) >= self.window and (first or st.since >= self.interval(b)):
                st.phase, st.before, st.explored, st.after = "explore", list(st.recent), [], []
                st.switch_steps = []
        self._last_bucket = b
        return st.other if st.phase == "explore" else st.running

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """The step run since the last ``plan``: ``rows`` rows made ``tokens`` tokens in ``seconds``."""
        self.inner.observe(rows, tokens, seconds)
        arm, b = self.last_arm, self._last_bucket
        self.last_arm = None
        if arm is None or b is None:
            return
        switched, self._prev_arm = arm != self._prev_arm, arm
        if seconds <= 0:
            return
        st = self._state(b)
        seen = st.seen[arm]
        seen[0], seen[1], seen[2] = seen[0] + tokens, seen[1] + seconds, seen[2] + 1
        step = (float(tokens), seconds)
        if switched:
            st.switches += 1
            if st.phase in ("explore", "back"):    # part of this bracket's price, not of its comparison
                st.switch_steps.append(step)
            return
        if arm == st.running:
            st.recent.append(step)
            st.since += 1
            if st.phase == "back":
                st.after.append(step)
                if len(st.after) >= self.window:
                    self._compare(st, b)
        elif st.phase == "explore":
            st.explored.append(step)
            if len(st.explored) >= self.window:
                st.phase = "back"

    def threshold(self, b: int) -> float:
        """The log ratio (speculation over plain) above which bucket ``b`` runs speculation."""
        return (math.log1p(self.hurdle) if b > 1 else 0.0) - math.log1p(self.margin)

    def _compare(self, st: _GateBucket, b: int) -> None:
        def rate(steps):
            return max(sum(t for t, _ in steps), 1e-9) / sum(s for _, s in steps)
        ran = st.before + st.after
        run, other = rate(ran), rate(st.explored)
        # the bracket's price in running-arm steps: its explored and switch steps' seconds beyond what
        # the running arm takes for the same tokens (a bracket that found the other arm faster costs nothing)
        lost = sum(s - t / run for t, s in st.explored + st.switch_steps)
        st.losses.append(max(0.0, lost) / (sum(s for _, s in ran) / len(ran)))
        was = st.running
        st.pairs.append(math.log(other / run) if st.running == "plain" else math.log(run / other))
        n = len(st.pairs)
        st.log_ratio = sum(st.pairs) / n
        need = self.threshold(b)
        st.running = "spec" if st.log_ratio >= need else "plain"
        # back off once the winner is clear: three comparisons or more, and a gap past 2 % by more than
        # their standard error (exploring a near-tie costs little, but exploring a clear loser often
        # costs throughput, the drafter catching up on the context at each switch; backing off on weaker
        # evidence would hold a noisy early lead through long spells)
        sd = math.sqrt(sum((x - st.log_ratio) ** 2 for x in st.pairs) / (n - 1)) if n > 1 else 0.0
        clear = n >= 3 and abs(st.log_ratio - need) - sd / math.sqrt(n) > math.log(1.02)
        st.backoff = min(st.backoff + 1, self.MAX_BACKOFF) if clear else 0
        if st.running != was:                  # the explored arm runs now: the old prices no longer apply
            st.losses.clear()
        st.budget_interval = (math.ceil(statistics.median(st.losses) / self.explore_budget)
                              if self.explore_budget > 0 and st.losses else 0)
        st.phase, st.since = "run", 0

    def plan(self, keys: list[Hashable], prev_survs: list[torch.Tensor | None]) -> list[bool]:
        """Plain steps draft nowhere; speculation leaves the choice to the inner policy (the other arm to
        ``alt``, where there is one)."""
        self.last_arm = self.choose(len(keys))
        if self.last_arm == "plain":
            if self.alt is not None:
                return self.alt.plan(keys, prev_survs)
            note = getattr(self.inner, "note_plain", None)
            if note is not None:                   # the inner policy learns from plain steps too
                note(len(keys))
            return [False] * len(keys)
        return self.inner.plan(keys, prev_survs)

    def note_plain(self, rows: int) -> None:
        """An outer gate runs a plain step: this gate's arms are idle, and its next step is a switch."""
        self._prev_arm, self.last_arm = None, None
        note = getattr(self.inner, "note_plain", None)
        if note is not None:
            note(rows)

    def __call__(self, survs: list[torch.Tensor | None], limits: list[int]) -> list[int]:
        if self.last_arm == "plain" and self.alt is not None:
            return self.alt(survs, limits)
        return self.inner(survs, limits)

    def forget(self, key: Hashable) -> None:
        """Drop a finished request's per-request scheduler state."""
        self.inner.forget(key)
        if self.alt is not None:
            self.alt.forget(key)

    def speculating(self) -> bool:
        if self.alt is not None:
            return self.last_arm is not None
        return self.last_arm == "spec" and self.inner.speculating() is not False

    def describe(self) -> dict:
        """Per concurrency bucket: each arm's throughput and steps, the ratio, the running arm and the
        exploration state."""
        def arm(v):
            return {"tok_s": round(v[0] / v[1], 2) if v[1] > 0 else 0.0, "steps": int(v[2])}
        a, o = self.labels
        out: dict = {str(b): {a: arm(st.seen["spec"]), o: arm(st.seen["plain"]),
                              f"{a}_vs_{o}": round(self.ratio(b), 3) if st.log_ratio is not None else None,
                              f"{a}_needs": round(math.exp(self.threshold(b)), 3),
                              "running": a if st.running == "spec" else o, "comparisons": len(st.pairs),
                              "switches": st.switches, "explore_interval": self.interval(b),
                              "bracket_cost_steps": (round(statistics.median(st.losses), 2) if st.losses else None)}
                     for b, st in sorted(self.buckets.items())}
        inner = self.inner.describe() if isinstance(self.inner, LiveGate) else None
        if inner:                                  # the length gate inside, per bucket
            for b, d in inner.items():
                out.setdefault(b, {})["lengths"] = d
        return out


def make_length_gate(scheduler: VerifyPolicy, explore_budget: float = GATE_EXPLORE_BUDGET, explore_every: int = 48,
                     window: int = 4) -> LiveGate:
    """The scheduler against verifying every drafted token, by measured throughput per concurrency bucket.

    The scheduler's verify lengths weigh each draft token's calibrated survival against the time the
    token adds to the step (the profiled SPS(B) or split step cost, plus the overhead it measures live).
    Where drafts are weak, that weighing is within its own errors: with 0.7 accepted tokens a round,
    the fourth draft survives a few percent of the time and adds about 2 % to a step, the same size as
    the calibration's ECE and as the gap between profiled and in-run step times, and the scheduler made
    0.89-1.02x the tokens/s of verifying every drafted token at 1 and 4 concurrent requests. Measuring both
    keeps whichever is faster on this host and this traffic; ties go to the scheduler (no hurdle: both
    arms speculate, so neither has a cost the bracket misses that the other lacks).
    """
    return LiveGate(scheduler, explore_every=explore_every, window=window, hurdle=0.0, explore_budget=explore_budget,
                    alt=_VERIFY_ALL, monotone=False, labels=("scheduled", "verify_all"))

"""The live calibrator: keeps a drafter's confidence calibration current from the rounds it serves.

Each loaded drafter with a confidence head gets one :class:`LiveCalibrator`. The engine hands it every
fully verified round (shadow rounds and rounds the policy verified whole: uncensored labels) as (raw
confidence logits of the block, accepted count); it keeps the last ``window`` of them, each with the
survival its request was sized with when it arrived (so the live ECE it reports is the prequential one:
every round judged by a calibration fitted before it). Every ``refit_every`` new rounds
it refits Sequential Temperature Scaling (+ shift) with the flow's fit
(:func:`dspark_core.calibration.guarded_refit`: the same grids and small-sample guards, every fourth
round held back, and a fit that does worse than the shipped calibration there is refused).

A refit costs CPU (about a second on a 2,048-round window on a 2-core host, where it competes with
decoding), so the interval adapts. A refit that brings no news (refused, or no better than the calibration
in use on the held-back rounds by more than that sample's noise: half its ECE floor, at least
``gain_tolerance``) doubles the interval, up to ``max_backoff`` times ``refit_every``; a window still too
small to fit does not count. A refit that beats the calibration in use brings it back to ``refit_every``.
So that a shift need not wait out a stretched interval, the calibrator also watches the calibration in use
for **drift**, at no fitting cost: over the rounds since the last refit it sums, per position, the
predicted survival minus the outcome, and compares that with its standard deviation under a calibrated
predictor (the square root of the summed p (1 - p)). Every ``refit_every`` rounds, a z-score above
``drift_z`` at any position starts a refit at once (``drift_refits`` counts them; the refit's news then
sets the interval as above). ``fit_seconds`` adds up the time fits took.

The fit runs off the engine thread (``submit``); its result waits in ``_pending`` and the engine swaps it
in between two steps (:meth:`LiveCalibrator.apply_pending`). A request is sized by the calibration that was active
when it was admitted, so its trace record names exactly one calibration (:meth:`LiveCalibrator.pin`).
Disabled, it still measures (the window and its ECE) but neither refits nor swaps: the shipped
calibration stays in use.

A pooled calibration is right on average over requests, and requests differ (one prompt's drafts are
accepted more than their confidences say for the whole answer, another's less): each request the
calibrator sizes can also get its own logit offset per position (:meth:`LiveCalibrator.request_offset`,
:class:`~dspark_core.engine.offset.RequestOffset`), learned from that request's earlier verified drafts and
shrunk toward the pooled calibration by ``request_prior`` pseudo-labels (0, the default: none; see
docs/serving.md for what it measured). It goes with the live calibrator: a disabled one leaves requests on
the shipped calibration, unadjusted.

Calibration only changes how many drafted tokens are verified, never which token is emitted: the output
stays the target's whatever the calibrator does. Thread-safety: the engine thread calls ``observe``,
``pin`` and ``apply_pending``; the fit thread calls ``refit``; admin handlers call ``describe``. One lock
guards the window and the state they share.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from dspark_core.calibration import Calibration, STSConfig, guarded_refit, position_ece, prefix_labels, survival
from dspark_core.data.traces import utc_now_iso
from dspark_core.engine.offset import RequestOffset

log = logging.getLogger("dspark.serving.calibration")


@dataclass(frozen=True)
class LiveCalibrationSettings:
    """How the live calibrator fits (the STS grids and guards are the flow's: :class:`STSConfig`)."""

    window: int = 2048             # fully verified rounds kept (the newest)
    refit_every: int = 256         # new rounds between refits
    min_rounds: int = 200          # rounds a fit needs (after the held-back quarter); fewer: refused
    holdback_every: int = 4        # every n-th round of the window is held back to judge the fit
    max_backoff: int = 8           # the refit interval grows up to refit_every x this while refits bring no news
    gain_tolerance: float = 0.002  # held-back mean per-position ECE a refit must gain over the calibration in use
                                   # to count as news
    drift_z: float = 3.0           # the calibration in use is off: |sum(predicted - outcome)| / sd over the rounds
                                   # since the last refit, at any position, above this starts a refit early
    request_prior: float = 0.0     # > 0: pseudo-labels that shrink each request's own offset toward the pooled
                                   # calibration (:class:`RequestOffset`); 0: no per-request offset

    def __post_init__(self):
        if (self.window < 8 or self.refit_every < 1 or self.min_rounds < 1 or self.holdback_every < 2
                or self.max_backoff < 1 or self.gain_tolerance < 0 or self.drift_z <= 0 or self.request_prior < 0):
            raise ValueError("live calibration: window must be >= 8, refit_every, min_rounds and max_backoff >= 1, "
                             "holdback_every >= 2, gain_tolerance >= 0, drift_z > 0, request_prior >= 0")

    def sts(self) -> STSConfig:
        # the refined search: the flow's objective, grids and guards at about a quarter of a refit's CPU, which
        # a refit takes from decoding on a small host
        return STSConfig(shift=True, min_rounds=self.min_rounds, search="refine")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _run_now(fn: Callable[[], None]) -> None:
    fn()


class LiveCalibrator:
    """One drafter's live calibration: a window of labelled rounds, the shipped calibration, the active one."""

    def __init__(self, domain: str, block: int, shipped: Calibration | None, settings: LiveCalibrationSettings,
                 metrics=None, submit: Callable[[Callable[[], None]], None] = _run_now, enabled: bool = True):
        self.domain, self.block, self.settings, self.metrics = domain, block, settings, metrics
        self.shipped = shipped
        self.reference = shipped or Calibration.identity(block)         # what a refit must beat
        self.active: Calibration | None = shipped                       # None: raw confidences
        self.version = 0                                                # accepted refits so far
        self.enabled = enabled
        self._submit = submit
        self._lock = threading.Lock()
        # (raw confidence logits [G], accepted, survival [G] the round was sized with: the calibration in use
        # on arrival, with the request's own offset when there is one)
        self._window: deque[tuple[list[float], int, list[float]]] = deque(maxlen=settings.window)
        self._since_refit = 0
        self.interval = settings.refit_every                            # new rounds before the next refit
        self.fit_seconds = 0.0
        self.drift_refits = 0
        self._bias = [0.0] * block       # per position, over the rounds since the last refit (or swap):
        self._var = [0.0] * block        # sum(predicted - outcome) and sum(p (1 - p))
        self._fitting = False
        self._pending: tuple[Calibration, dict] | None = None
        self.refits = 0
        self.refusals: dict[str, int] = {}
        self.last_refit: dict | None = None
        self.rounds_seen = 0

    # ---- engine thread ---------------------------------------------------------------------------------
    def pin(self) -> tuple[Callable | None, dict]:
        """The calibration a newly admitted request is sized with: (raw logits -> step probabilities, or
        None for raw confidences; its description for the trace record)."""
        cal = self.active
        source = "none" if cal is None else ("live" if self.version else "shipped")
        info = {"source": source, "version": self.version,
                "temperatures": [float(t) for t in cal.temperatures] if cal else [],
                "shifts": [float(b) for b in cal.shifts] if cal else [],
                "request_prior": self.settings.request_prior if self.enabled else 0.0}
        return (cal.apply if cal is not None else None), info

    def request_offset(self) -> RequestOffset | None:
        """A newly admitted request's own offset (:class:`RequestOffset`), or None: disabled (the shipped
        calibration stays in use, unadjusted) or ``request_prior`` 0."""
        return RequestOffset(self.settings.request_prior) if self.enabled and self.settings.request_prior > 0 else None

    def observe(self, confidence_logits: list[float] | None, accepted: int, used: list[float] | None = None) -> None:
        """One fully verified round of this drafter (its whole block's raw confidence logits, and the survival
        it was sized with when a request offset adjusted it). The window's live ECE judges ``used``; the
        drift watch judges the pooled calibration alone, which is what a refit replaces."""
        if confidence_logits is None or len(confidence_logits) != self.block:
            return
        conf = torch.tensor([confidence_logits], dtype=torch.float32)
        cal = self.active
        predicted = (cal.survival(conf) if cal is not None else survival(conf))[0].tolist()
        sized = list(used) if used is not None and len(used) == self.block else predicted
        with self._lock:
            self._window.append((list(confidence_logits), int(accepted), sized))
            self.rounds_seen += 1
            self._since_refit += 1
            for k, p in enumerate(predicted):
                self._bias[k] += p - (accepted > k)
                self._var[k] += p * (1.0 - p)
            due = self._since_refit >= self.interval and not self._fitting
            if (not due and not self._fitting and self._since_refit % self.settings.refit_every == 0
                    and self.drift_score() > self.settings.drift_z):
                due = True
                self.drift_refits += self.enabled
            if due:
                self._since_refit = 0
                self._fitting = self.enabled
                self._bias, self._var = [0.0] * self.block, [0.0] * self.block
        if self.metrics is not None:
            self.metrics.live_cal_rounds.labels(self.domain).set(len(self._window))
            if due and not self.enabled:                # measured all the same: the ECE gauges stay current
                self._publish_ece()
        if due and self.enabled:
            try:
                self._submit(self.refit)
            except RuntimeError as e:                 # the fit pool is shut down (server stopping)
                log.debug("live refit for %s not submitted: %s", self.domain, e)
                with self._lock:
                    self._fitting = False

    def apply_pending(self) -> bool:
        """Swap in a refit that finished since the last call (engine thread, between steps)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None or not self.enabled:
            return False
        self.active, self.version = pending[0], self.version + 1
        with self._lock:                               # rounds from now on are predicted by the new calibration
            self._bias, self._var = [0.0] * self.block, [0.0] * self.block
        if self.metrics is not None:
            self.metrics.live_cal_version.labels(self.domain).set(self.version)
        return True

    def reset(self) -> None:
        """Forget the window and go back to the shipped calibration (a drafter swap, an admin reset)."""
        with self._lock:
            self._window.clear()
            self._since_refit, self._pending = 0, None
            self.interval = self.settings.refit_every
            self._bias, self._var = [0.0] * self.block, [0.0] * self.block
        self.active, self.version = self.shipped, 0
        if self.metrics is not None:
            self.metrics.live_cal_rounds.labels(self.domain).set(0)
            self.metrics.live_cal_version.labels(self.domain).set(0)

    def drift_score(self) -> float:
        """The largest per-position z-score of the calibration in use over the rounds since the last refit:
        |sum(predicted survival - outcome)| / sqrt(sum p (1 - p)); about N(0, 1) while it is calibrated."""
        return max((abs(b) / (v ** 0.5) if v > 0 else 0.0) for b, v in zip(self._bias, self._var))

    # ---- fit thread ------------------------------------------------------------------------------------
    def window_data(self, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(raw logits [N, G], accepted [N], survival the round was sized with [N, G]) of the window's newest
        ``last`` rounds (all by default), or None when it is empty."""
        with self._lock:
            rows = list(self._window)
        if last is not None:
            rows = rows[-last:] if last > 0 else []
        if not rows:
            return None
        return (torch.tensor([c for c, _, _ in rows]), torch.tensor([a for _, a, _ in rows]),
                torch.tensor([p for _, _, p in rows]))

    def rows_since(self, seen: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]:
        """The rounds observed after the first ``seen`` (as :meth:`window_data`, at most the window's worth)
        and how many have been observed now, read together: a reader that passes back the count it got
        sees every round once, however long it keeps them (longer than the window)."""
        with self._lock:
            now = self.rounds_seen
            new = min(now - seen, len(self._window))
            rows = list(self._window)[len(self._window) - new:] if new > 0 else []
        if not rows:
            return None, now
        return (torch.tensor([c for c, _, _ in rows]), torch.tensor([a for _, a, _ in rows]),
                torch.tensor([p for _, _, p in rows])), now

    def refit(self) -> dict:
        """Refit on the current window; an accepted fit becomes pending (swapped in by the engine).
        Returns what was decided (also kept as ``last_refit``)."""
        t0 = time.perf_counter()
        try:
            data = self.window_data()
            if data is None:
                decision = {"accepted": False, "reason": "too_few_rounds", "rounds_fit": 0, "rounds_heldback": 0}
                cal = None
            else:
                res = guarded_refit(data[0], data[1], self.reference, self.settings.sts(), self.settings.holdback_every,
                                    active=self.active or Calibration.identity(self.block))
                decision, cal = res.to_dict(), res.calibration
            decision["at"] = utc_now_iso()
            # news: the candidate beats the calibration in use on the held-back rounds by more than half the
            # ECE a perfectly calibrated predictor shows on that many rounds (the two are read on the same
            # labels, so their difference is less noisy than either), and by at least gain_tolerance
            news = (cal is not None and bool(decision.get("ece_active")) and
                    _mean(decision["ece_active"]) - _mean(decision["ece_candidate"])
                    > max(self.settings.gain_tolerance, 0.5 * _mean(decision.get("ece_active_floor", []))))
            decision["news"] = news
            with self._lock:
                top = self.settings.refit_every * self.settings.max_backoff
                if news:
                    self.interval = self.settings.refit_every
                elif decision["reason"] != "too_few_rounds":      # a window still filling is no evidence
                    self.interval = min(top, 2 * self.interval)
                decision["next_after"] = self.interval
                if cal is not None:
                    self._pending = (cal, decision)
                    self.refits += 1
                else:
                    self.refusals[decision["reason"]] = self.refusals.get(decision["reason"], 0) + 1
                self.last_refit = decision
            if self.metrics is not None:
                if cal is not None:
                    self.metrics.live_cal_refits.labels(self.domain).inc()
                else:
                    self.metrics.live_cal_refusals.labels(self.domain, decision["reason"]).inc()
                self._publish_ece(data)
            return decision
        except Exception:                          # a failed fit keeps the calibration in use
            log.exception("live calibration refit for %s failed", self.domain)
            return {"accepted": False, "reason": "error"}
        finally:
            with self._lock:
                self._fitting = False
                self.fit_seconds += time.perf_counter() - t0

    def window_ece(self, data=None, last: int | None = None) -> dict:
        """Per-position ECE over the window's newest ``last`` rounds (all by default): of the raw
        confidences, of the shipped calibration, and ``live``: of the survival each round was sized with
        (the calibration in use when it arrived and its request's offset: prequential, never judged on rounds
        it was fitted on)."""
        data = data if data is not None else self.window_data(last)
        if data is None:
            return {"rounds": 0, "raw": [], "shipped": [], "live": []}
        conf, acc, predicted = data
        labels = prefix_labels(acc, self.block)
        raw = position_ece(survival(conf), labels)
        return {"rounds": int(conf.shape[0]), "raw": raw,
                "shipped": position_ece(self.shipped.survival(conf), labels) if self.shipped else raw,
                "live": position_ece(predicted, labels)}

    def _publish_ece(self, data=None) -> None:
        e = self.window_ece(data)
        for kind in ("raw", "shipped", "live"):
            for k, v in enumerate(e[kind], 1):
                self.metrics.live_cal_ece.labels(self.domain, str(k), kind).set(v)

    # ---- admin -----------------------------------------------------------------------------------------
    def describe(self, with_ece: bool = False) -> dict:
        cal = self.active
        with self._lock:
            out = {"enabled": self.enabled, "window_rounds": len(self._window), "window_size": self.settings.window,
                   "rounds_seen": self.rounds_seen, "refit_every": self.settings.refit_every,
                   "refit_interval": self.interval, "fit_seconds": round(self.fit_seconds, 3),
                   "drift_z": round(self.drift_score(), 3), "drift_refits": self.drift_refits,
                   "version": self.version, "source": "none" if cal is None else ("live" if self.version else "shipped"),
                   "request_prior": self.settings.request_prior if self.enabled else 0.0,
                   "temperatures": list(cal.temperatures) if cal else [], "shifts": list(cal.shifts) if cal else [],
                   "shipped": {"temperatures": list(self.shipped.temperatures), "shifts": list(self.shipped.shifts)}
                   if self.shipped else None,
                   "refits": self.refits, "refusals": dict(self.refusals), "last_refit": self.last_refit,
                   "fitting": self._fitting}
        if with_ece:
            out["ece"] = self.window_ece()
        return out


def replay(conf: torch.Tensor, accepted: torch.Tensor, shipped: Calibration | None,
           settings: LiveCalibrationSettings) -> tuple[torch.Tensor, LiveCalibrator]:
    """Recorded fully verified rounds (raw confidence logits [N, G] and accepted counts [N], in arrival
    order) fed through a fresh live calibrator with ``settings``: each refit runs as soon as it is due and
    is swapped in before the next round, where a server fits off the engine thread and swaps a few rounds
    later. Returns the survival each round was sized with [N, G] (what the live ECE judges) and the
    calibrator (its refits, refusals and final calibration). Deterministic, so two settings replayed on the
    same rounds differ only by what the settings do."""
    live = LiveCalibrator("replay", int(conf.shape[1]), shipped, settings)
    sized = []
    for raw, acc in zip(conf.tolist(), accepted.tolist()):
        live.observe(raw, int(acc))
        sized.append(live._window[-1][2])
        live.apply_pending()
    return torch.tensor(sized, dtype=torch.float32).view(-1, int(conf.shape[1])), live

"""Per-domain drafter slots: start-up loading, admin reload / rollback, registry polling, canary.

Loading (download, weights) happens on the caller's thread; the swap itself runs on the engine thread
between two steps (``engine.call``), so a step never sees a half-swapped slot. A request keeps the
drafter it was admitted with until it finishes (its proposer state belongs to that drafter); new
requests get the new one. Either way the output is the target's (speculation is lossless).

Canary: a swap remembers the previous drafter's live acceptance (accepted / drafted over its window).
Once the new drafter has drafted ``canary_rounds`` rounds, its acceptance since the swap is compared;
below ``canary_ratio`` x the previous one the manager swaps back, marks the version rejected (the poller
will not load it again until the alias moves elsewhere), and records it in the audit log and metrics.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from .audit import AuditLog
from .calibrator import LiveCalibrationSettings, LiveCalibrator
from .drafters import DrafterNotFound, DrafterSource, LoadedDrafter, RollbackUnsupported
from .metrics import ServingMetrics
from .settings import ServeSettings

log = logging.getLogger("dspark.serving.drafters")
T = TypeVar("T")


def _run_here(fn: Callable[[], T]) -> T:
    return fn()


REFIT_NICE = 10        # the live-refit thread's niceness above the server's (Linux; elsewhere unchanged)


def lower_thread_priority(nice: int = REFIT_NICE) -> bool:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: niceness is per thread, and the
    threads it starts for torch's parallel loops inherit it), so work on it yields the cores to the
    engine's decoding. Returns whether it took effect."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except (AttributeError, OSError):
        return False


class ConflictError(RuntimeError):
    """The action cannot run in the slot's current state (e.g. nothing to roll back to)."""


class UnknownDomain(LookupError):
    """The server does not serve that domain."""


@dataclass
class Canary:
    new: LoadedDrafter
    previous: LoadedDrafter
    baseline: float
    start_drafted: int
    start_accepted: int
    start_rounds: int
    status: str = "running"            # running | passed | rolled_back
    previous_follow: str | None = None  # what the slot followed before the swap (restored on rollback)
    observed: float | None = None

    def describe(self) -> dict:
        return {"new": self.new.label, "previous": self.previous.label, "baseline": round(self.baseline, 4),
                "observed": None if self.observed is None else round(self.observed, 4), "status": self.status,
                "rounds": self.new.window.total_rounds - self.start_rounds}


@dataclass
class Slot:
    domain: str
    current: LoadedDrafter | None = None
    previous: LoadedDrafter | None = None
    follow: str | None = None          # alias followed by the poller; None = pinned to a version
    rejected: set[int] = field(default_factory=set)
    canary: Canary | None = None
    note: str = ""
    live_calibration: bool = True      # the live calibrator of this domain's drafter refits


class DrafterManager:
    def __init__(self, source: DrafterSource, settings: ServeSettings, metrics: ServingMetrics, audit: AuditLog,
                 domains: list[str]):
        self.source, self.settings, self.metrics, self.audit = source, settings, metrics, audit
        self.speculate = settings.policy != "none"
        self.slots = {d: Slot(d, follow=settings.alias, live_calibration=settings.live_calibration
                              and d not in settings.live_calibration_off) for d in domains}
        self.live_settings = LiveCalibrationSettings(settings.live_window, settings.live_refit_every,
                                                     settings.live_min_rounds, max_backoff=settings.live_max_backoff,
                                                     request_prior=settings.live_request_prior)
        # live refits run here, off the engine thread, one at a time and at a lower CPU priority: a refit
        # takes 1-2 s of a core on a 2-core host, and at full priority it slowed decoding by several per cent
        self._fit_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-calibration",
                                            initializer=lower_thread_priority)
        self._lock = threading.RLock()         # slot fields
        self._load_lock = threading.Lock()     # one load / swap decision at a time
        self._run_in_engine: Callable[[Callable[[], T]], T] = _run_here   # see attach_engine
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    def attach_engine(self, run_in_engine: Callable[[Callable[[], T]], T]) -> None:
        """Run every swap through ``run_in_engine(fn)``, which runs ``fn`` on the engine thread between two
        steps and returns its result (:meth:`serving.engine.Engine.call`). Until an engine is attached,
        swaps run on the caller's thread (nothing is decoding yet)."""
        self._run_in_engine = run_in_engine

    # ---- start-up -----------------------------------------------------------------------------------
    def start_up(self) -> None:
        for domain, slot in self.slots.items():
            if not self.speculate:
                slot.note = "speculation off (--policy none)"
                self.metrics.active_version.labels(domain).set(-1)
                continue
            try:
                slot.current = self._with_live(self.source.load(domain, alias=self.settings.alias), slot)
                slot.note = ""
                self.metrics.active_version.labels(domain).set(_version_value(slot.current))
                log.info("domain %s: loaded %s", domain, slot.current.label)
            except DrafterNotFound as e:
                slot.note = f"no registered drafter, runs without speculation ({e})"
                self.metrics.active_version.labels(domain).set(-1)
                log.warning("domain %s: %s", domain, slot.note)
            except Exception as e:      # noqa: BLE001 - a bad drafter costs its domain speculation, never the server
                slot.note = f"drafter failed to load, runs without speculation: {e}"
                self.metrics.active_version.labels(domain).set(-1)
                log.error("domain %s: %s", domain, slot.note)
            self.audit.record("load", domain, "startup", "ok" if slot.current else "no_drafter",
                              drafter=slot.current.label if slot.current else None, note=slot.note)

    def current(self, domain: str) -> LoadedDrafter | None:
        with self._lock:
            slot = self.slots.get(domain)
            return slot.current if slot is not None else None

    def loaded(self) -> list[LoadedDrafter]:
        with self._lock:
            return [s.current for s in self.slots.values() if s.current is not None]

    # ---- live calibration ---------------------------------------------------------------------------
    def _with_live(self, drafter: LoadedDrafter | None, slot: Slot) -> LoadedDrafter | None:
        """Give ``drafter`` a live calibrator seeded with its shipped calibration (a fresh window: a drafter
        that comes back after a swap starts over too)."""
        if drafter is None:
            return None
        if drafter.live is None:
            drafter.live = LiveCalibrator(slot.domain, drafter.proposer.max_block, drafter.calibration,
                                          self.live_settings, self.metrics, submit=self._fit_pool.submit,
                                          enabled=slot.live_calibration)
        else:
            drafter.live.reset()
            drafter.live.enabled = slot.live_calibration
        return drafter

    def live_calibrators(self) -> list[LiveCalibrator]:
        with self._lock:
            return [s.current.live for s in self.slots.values() if s.current is not None and s.current.live]

    def calibration(self, domain: str) -> dict:
        """The live calibration state of the domain's drafter, with its window's per-position ECE."""
        slot = self._slot(domain)
        cur = slot.current
        return {"domain": domain, "drafter": cur.label if cur else None, "enabled": slot.live_calibration,
                "live": cur.live.describe(with_ece=True) if cur is not None and cur.live is not None else None}

    def set_calibration(self, domain: str, enabled: bool | None = None, reset: bool = False, refit: bool = False,
                        actor: str = "admin") -> dict:
        """Enable or disable the domain's live calibrator (disabled: back to the shipped calibration for new
        requests), reset its window, or refit now (on this thread; the engine swaps the result in)."""
        slot = self._slot(domain)
        cur = slot.current
        if (reset or refit) and (cur is None or cur.live is None):
            raise ConflictError(f"domain {domain!r} has no drafter with a live calibrator")
        with self._lock:
            if enabled is not None:
                slot.live_calibration = enabled
        live = cur.live if cur is not None else None
        if live is not None:
            if enabled is not None and enabled != live.enabled:
                self._run_in_engine(lambda: _set_enabled(live, enabled))
            if reset:
                self._run_in_engine(live.reset)
        decision = live.refit() if refit and live is not None else None
        self.audit.record("calibration", domain, actor, "ok", enabled=slot.live_calibration, reset=reset,
                          refit=decision)
        return {**self.calibration(domain), "refit": decision}

    # ---- swaps --------------------------------------------------------------------------------------
    def _swap(self, domain: str, new: LoadedDrafter | None, reason: str, canary: bool) -> LoadedDrafter | None:
        """Engine thread, between steps: make ``new`` the domain's drafter for newly admitted requests."""
        with self._lock:
            slot = self.slots[domain]
            self._with_live(new, slot)
            old, slot.current, slot.previous = slot.current, new, slot.current
            slot.canary = None
            base = old.window.snapshot() if old is not None else None
            if canary and new is not None and base and base["rounds"] >= self.settings.canary_rounds:
                w = new.window
                slot.canary = Canary(new, old, base["acceptance"] or 0.0, w.total_drafted, w.total_accepted,
                                     w.total_rounds)
            slot.note = ""
        self.metrics.swaps.labels(domain, reason).inc()
        self.metrics.active_version.labels(domain).set(_version_value(new))
        return old

    def _slot(self, domain: str) -> Slot:
        slot = self.slots.get(domain)
        if slot is None:
            raise UnknownDomain(f"unknown domain {domain!r}; served domains: {', '.join(self.slots)}")
        return slot

    def reload(self, domain: str, alias: str | None = None, version: int | None = None, actor: str = "admin",
               reason: str = "") -> dict:
        """Load the domain's drafter from ``alias`` (default: the configured alias) or pin ``version``, then
        swap it in between engine steps. Loading the version already in use changes nothing."""
        slot = self._slot(domain)
        if not self.speculate:
            raise ConflictError("speculation is off (--policy none): nothing to reload")
        if alias is None and version is None:
            alias = self.settings.alias
        with self._load_lock:
            cur = slot.current
            try:
                new = self.source.load(domain, alias=alias, version=version)
            except Exception as e:
                self.audit.record("reload", domain, actor, "failed", alias=alias, version=version, error=str(e))
                raise
            with self._lock:
                prev_follow, slot.follow = slot.follow, (alias if version is None else None)
                if actor == "admin" and new.version is not None:
                    slot.rejected.discard(new.version)        # an explicit admin load overrides a verdict
            if cur is not None and new.version is not None and cur.version == new.version \
                    and cur.source == new.source:
                out = {"domain": domain, "swapped": False, "drafter": cur.label, "version": cur.version,
                       "following": slot.follow}
                self.audit.record("reload", domain, actor, "unchanged", alias=alias, version=new.version,
                                  reason=reason)
                return out
            old = self._run_in_engine(lambda: self._swap(domain, new, actor, canary=True))
            with self._lock:
                if slot.canary is not None:
                    slot.canary.previous_follow = prev_follow
        entry = self.audit.record("reload", domain, actor, "swapped", alias=alias, version=new.version,
                                  drafter=new.label, previous=old.label if old else None, reason=reason)
        return {"domain": domain, "swapped": True, "drafter": new.label, "version": new.version,
                "previous": old.label if old else None, "previous_version": old.version if old else None,
                "following": slot.follow, "canary": slot.canary.describe() if slot.canary else None,
                "audit": entry}

    def rollback(self, domain: str, actor: str = "admin", reason: str = "", registry: bool = False) -> dict:
        """Swap back to the drafter this server used before (and mark the current version rejected). With
        ``registry``, first move the registry's champion back and load that version."""
        slot = self._slot(domain)
        with self._load_lock:
            bad = slot.current
            if registry:
                try:
                    champion = self.source.rollback(domain, reason or f"rollback by {actor}")
                except RollbackUnsupported as e:
                    raise ConflictError(str(e)) from None
                target = self.source.load(domain, version=champion)
                with self._lock:
                    slot.follow = self.settings.alias
            else:
                if slot.previous is None:
                    raise ConflictError(f"domain {domain!r} has no previous drafter in this server to roll back to")
                target = slot.previous
            with self._lock:
                if bad is not None and bad.version is not None:
                    slot.rejected.add(bad.version)
            self._run_in_engine(lambda: self._swap(domain, target, "rollback", canary=False))
        self.metrics.rollbacks.labels(domain, "manual").inc()
        entry = self.audit.record("rollback", domain, actor, "swapped", drafter=target.label,
                                  version=target.version, rolled_back=bad.label if bad else None,
                                  registry=registry, reason=reason)
        return {"domain": domain, "drafter": target.label, "version": target.version,
                "rolled_back": bad.label if bad else None, "rejected_versions": sorted(slot.rejected),
                "audit": entry}

    # ---- live acceptance and the canary (engine thread) ---------------------------------------------
    def observe_round(self, drafter: LoadedDrafter, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        drafter.window.observe(drafted, accepted)
        slot = self.slots.get(drafter.domain)
        if slot is None:
            return
        if slot.current is drafter:
            rate = drafter.window.rate()
            if rate is not None:
                self.metrics.live_acceptance.labels(drafter.domain).set(rate)
        c = slot.canary
        if c is None or c.status != "running" or c.new is not drafter:
            return
        w = drafter.window
        if w.total_rounds - c.start_rounds < self.settings.canary_rounds:
            return
        d, a = w.total_drafted - c.start_drafted, w.total_accepted - c.start_accepted
        c.observed = a / d if d else 0.0
        if c.observed < self.settings.canary_ratio * c.baseline:
            self._swap(drafter.domain, c.previous, "canary_rollback", canary=False)
            with self._lock:
                if drafter.version is not None:
                    slot.rejected.add(drafter.version)
                c.status = "rolled_back"
                slot.canary, slot.follow = c, c.previous_follow
                slot.note = f"canary rolled back {drafter.label}"
            self.metrics.rollbacks.labels(drafter.domain, "canary").inc()
            self.audit.record("canary_rollback", drafter.domain, "canary", "rolled_back", drafter=drafter.label,
                              restored=c.previous.label, observed=round(c.observed, 4),
                              baseline=round(c.baseline, 4), ratio=self.settings.canary_ratio)
        else:
            c.status = "passed"
            self.audit.record("canary", drafter.domain, "canary", "passed", drafter=drafter.label,
                              observed=round(c.observed, 4), baseline=round(c.baseline, 4))

    # ---- registry polling ---------------------------------------------------------------------------
    def poll_once(self) -> list[dict]:
        """Reload every domain whose followed alias now points at another (not rejected) version."""
        out = []
        if not self.speculate:
            return out
        for domain, slot in self.slots.items():
            if slot.follow is None:
                continue
            try:
                v = self.source.alias_version(domain, slot.follow)
                cur = slot.current.version if slot.current is not None else None
                if v is None or v == cur or v in slot.rejected:
                    continue
                out.append(self.reload(domain, alias=slot.follow, actor="poller",
                                       reason=f"alias {slot.follow} moved to v{v}"))
            except Exception as e:          # a registry hiccup must not stop the poller
                self.metrics.poll_errors.inc()
                log.warning("registry poll for %s failed: %s", domain, e)
        return out

    def start_polling(self) -> None:
        if self.settings.poll_interval <= 0 or not self.speculate or self._poller is not None:
            return

        def run():
            while not self._stop.wait(self.settings.poll_interval):
                self.poll_once()
        self._poller = threading.Thread(target=run, name="dspark-registry-poller", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        self._fit_pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        with self._lock:
            return {d: {"domain": d, "speculation": s.current is not None, "live_calibration": s.live_calibration,
                        "drafter": s.current.describe() if s.current else None,
                        "previous": s.previous.label if s.previous else None,
                        "following": s.follow, "rejected_versions": sorted(s.rejected),
                        "canary": s.canary.describe() if s.canary else None, "note": s.note}
                    for d, s in self.slots.items()}


def _set_enabled(live: LiveCalibrator, enabled: bool) -> None:
    """Engine thread: a disabled calibrator stops collecting and new requests get the shipped calibration."""
    live.enabled = enabled
    if not enabled:
        live.reset()


def _version_value(d: LoadedDrafter | None) -> int:
    return -1 if d is None else (d.version if d.version is not None else 0)

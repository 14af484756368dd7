"""What the flows hand each other and return: small frozen dataclasses (no Prefect import here).

Each has ``to_dict()`` for JSON (the CLI's ``--json``, the report); the one a task persists in Prefect's
result store (:class:`WarmStart`) also has ``from_dict()`` to read it back. Metrics stay a mapping from
MLflow metric name to value (a per-position metric is a list), because that is what the registry logs
and returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dspark_core.pipeline.steps import CalibrationSummary, ProfileSummary, TrainSummary
from registry.warehouse import LandingIngest, LiveAcceptance

from .handoff import LiveCalibrationState, ReloadResult

Metrics = dict[str, float | list[float]]


@dataclass(frozen=True)
class WarmStart:
    """Where one domain's training starts: its champion (``version``) or the generic drafter."""

    init: str                       # "champion" or "generic"
    version: int | None = None      # the champion's version when init is "champion"

    def to_dict(self) -> dict:
        return {"init": self.init} if self.version is None else {"init": self.init, "version": self.version}

    @classmethod
    def from_dict(cls, d: dict) -> "WarmStart":
        return cls(d["init"], d.get("version"))


@dataclass(frozen=True)
class Challenger:
    """A trained drafter and what the pipeline measured of it, ready for evaluation and the gate: its
    checkpoint, the held-out snapshot to evaluate on, the calibration and SPS(B) profile (registered with
    it), the training run, and version tags from the pipeline (trace window, data key, warm start)."""

    checkpoint: str
    heldout: str
    calibration: CalibrationSummary | None = None
    sps: ProfileSummary | None = None
    train: TrainSummary | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def plots(self) -> list[str]:
        return [p for p in (self.reliability_plot, self.sps_plot) if p]

    @property
    def reliability_plot(self) -> str | None:
        return None if self.calibration is None else self.calibration.plot

    @property
    def sps_plot(self) -> str | None:
        return None if self.sps is None else self.sps.plot


@dataclass(frozen=True)
class Baseline:
    """The champion a challenger was compared with: its version, tau and speedup measured in the same run
    as the challenger's, and its registered per-position ECE (raw and calibrated)."""

    version: int
    tau: float
    speedup: float
    ece_raw: float | list[float] | None = None
    ece_calibrated: float | list[float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DomainOutcome:
    """One domain's evaluation and gate: the registered version, the decision (``promoted``, ``refused``
    or ``already champion``) and the gate's reasons, the champion it was compared with (``before``), the
    metrics registered with it (``after``), its plots, the serving hand-off after a promotion, and the
    warm start its training began from."""

    domain: str
    version: int
    model_uri: str
    decision: str
    promoted: bool
    reasons: list[str]
    before: Baseline | None
    after: Metrics
    reliability_plot: str | None = None
    sps_plot: str | None = None
    handoff: ReloadResult | None = None
    warm_start: str | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "before": None if self.before is None else self.before.to_dict(),
                "handoff": None if self.handoff is None else self.handoff.to_dict()}


@dataclass(frozen=True)
class DriftVerdict:
    """The drift check of one domain: the verdict line and, when the domain has a champion with an
    evaluated tau, the evidence (live acceptance, champion version and tau)."""

    verdict: str
    live: LiveAcceptance | None = None
    champion_version: int | None = None
    champion_tau: float | None = None
    live_calibration: LiveCalibrationState | None = None     # serving's live ECE, when it was asked

    def to_dict(self) -> dict:
        if self.live is None:
            return {"verdict": self.verdict}
        out = {"verdict": self.verdict, "live": self.live.to_dict(), "champion_version": self.champion_version,
               "champion_tau": self.champion_tau}
        if self.live_calibration is not None:
            out["live_calibration"] = self.live_calibration.to_dict()
        return out


@dataclass(frozen=True)
class DriftReport:
    """The domains whose live acceptance since ``since`` fell more than ``margin`` below their champion's,
    and the verdict of every domain checked."""

    drifted: list[str]
    details: dict[str, DriftVerdict]
    since: str
    margin: float

    def to_dict(self) -> dict:
        return {"drifted": list(self.drifted), "details": {d: v.to_dict() for d, v in self.details.items()},
                "since": self.since, "margin": self.margin}


@dataclass(frozen=True)
class RetrainSummary:
    """One retrain run: the budget preset, the target, the domains it covered, the ingest (and drift
    check) it started from, each domain's outcome, the domains that failed (with why), its wall time and
    the path of its Markdown report."""

    budget: str
    target_fingerprint: str
    domains: list[str]
    ingest: LandingIngest
    drift: DriftReport | None
    results: dict[str, DomainOutcome]
    errors: dict[str, str]
    seconds: float
    report: str = ""

    def to_dict(self) -> dict:
        return {"budget": self.budget, "target_fingerprint": self.target_fingerprint, "domains": list(self.domains),
                "ingest": self.ingest.to_dict(), "drift": None if self.drift is None else self.drift.to_dict(),
                "results": {d: o.to_dict() for d, o in self.results.items()}, "errors": dict(self.errors),
                "seconds": self.seconds, "report": self.report}

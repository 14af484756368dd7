"""Server settings: one frozen object, built by the ``dspark serve`` entry point from argv and env."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

POLICIES = ("scheduled", "fixed", "none")


@dataclass(frozen=True)
class ServeSettings:
    """Everything the app, the engine and the drafter manager read. No env access below the CLI."""

    home: Path = Path(".dspark")
    landing: Path | None = None               # default: <home>/landing
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    policy: str = "scheduled"                 # scheduled | fixed | none (no speculation at all)
    shadow_fraction: float = 0.05             # rounds that verify the whole block (uncensored labels)
    poll_interval: float = 30.0               # seconds between registry alias polls; 0 = never
    domains: tuple[str, ...] = ()
    default_domain: str = "chat"
    alias: str = "champion"                   # registry alias each domain follows at start-up
    drafter_dir: Path | None = None           # local checkpoints instead of a registry
    tracking_uri: str | None = None           # MLflow registry; None = no registry
    artifact_location: str | None = None
    sps_path: Path | None = None              # SPS(B) profile(s) for the scheduled policy
    live_gate: bool = True                    # scheduled: skip speculation where live throughput says so
    length_gate: bool = True                  # live gate: scheduler vs verify-every-draft, the faster measured
    gate_hurdle: float = 0.04                 # live gate: above one row speculation must be this much faster
                                              # (dspark_core.scheduling.GATE_HURDLE; not imported: no torch here)
    gate_explore_budget: float = 0.02         # live gate: share of time its comparisons may lose (GATE_EXPLORE_BUDGET)
    max_model_len: int | None = None          # context limit; default: the target's
    max_tokens_default: int = 256             # chat completions without max_tokens
    canary_rounds: int = 64                   # new drafter's drafting rounds before the canary verdict
    canary_ratio: float = 0.7                 # roll back when new acceptance < ratio x previous
    acceptance_window: int = 512              # rounds in the live-acceptance window
    max_draft_tokens: int | None = None       # cap on draft tokens per round; None = each drafter's block
    prompt_lookup: bool = False               # prompt lookup in front of each drafter (copy where text repeats)
    traces: bool = True
    trace_buffer: int = 4096                  # records queued for the writer; beyond it they are dropped
    trace_rotate_bytes: int = 64 << 20
    trace_rotate_seconds: float = 3600.0
    max_request_bytes: int = 1 << 20          # request bodies above this are a 413, never read whole
    max_queued: int = 256                     # requests waiting for a batch slot; beyond it a 429 + Retry-After
    live_calibration: bool = True             # refit each drafter's calibration from the rounds it serves
    live_calibration_off: tuple[str, ...] = ()  # domains whose live calibrator starts disabled
    live_window: int = 2048                   # fully verified rounds the live calibrator keeps
    live_refit_every: int = 256               # new rounds between live refits
    live_min_rounds: int = 200                # rounds a live refit needs; fewer: the calibration stays
    live_max_backoff: int = 8                 # refits without news stretch the interval up to this many times
                                              # live_refit_every (1: a refit every live_refit_every rounds)
    live_request_prior: float = 0.0           # > 0: each request's own confidence offset, shrunk by this many
                                              # pseudo-labels toward the live calibration (10 is the measured
                                              # choice); 0 = no offset
    memory_trim_interval: float = 30.0        # seconds between returning freed heap pages to the system; 0 = never
    admin_token: str | None = field(default=None, repr=False)
    served_model_name: str | None = None      # default: the target's name

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose {', '.join(POLICIES)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError(f"shadow_fraction must be in [0, 1], got {self.shadow_fraction}")
        if self.poll_interval < 0:
            raise ValueError(f"poll_interval must be >= 0, got {self.poll_interval}")
        if not 0.0 <= self.canary_ratio <= 1.0:
            raise ValueError(f"canary_ratio must be in [0, 1], got {self.canary_ratio}")
        if self.canary_rounds < 1 or self.acceptance_window < 1:
            raise ValueError("canary_rounds and acceptance_window must be >= 1")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if not 0.0 <= self.gate_hurdle < 1.0:
            raise ValueError(f"gate_hurdle must be in [0, 1), got {self.gate_hurdle}")
        if not 0.0 <= self.gate_explore_budget < 1.0:
            raise ValueError(f"gate_explore_budget must be in [0, 1), got {self.gate_explore_budget}")
        if self.trace_buffer < 1:
            raise ValueError(f"trace_buffer must be >= 1, got {self.trace_buffer}")
        if self.live_window < 8 or self.live_refit_every < 1 or self.live_min_rounds < 1 or self.live_max_backoff < 1:
            raise ValueError("live_window must be >= 8, live_refit_every, live_min_rounds and live_max_backoff >= 1")
        if not self.live_request_prior >= 0:
            raise ValueError(f"live_request_prior must be >= 0, got {self.live_request_prior}")
        if self.max_request_bytes < 1024 or self.max_queued < 1:
            raise ValueError("max_request_bytes must be >= 1024 and max_queued >= 1")

    @property
    def landing_dir(self) -> Path:
        return Path(self.landing) if self.landing is not None else Path(self.home) / "landing"

    @property
    def audit_path(self) -> Path:
        return Path(self.home) / "serving" / "audit.jsonl"

    @property
    def drafter_cache(self) -> Path:
        return Path(self.home) / "serving" / "drafters"

"""Acceptance statistics of speculative decoding, as plain data.

Every decode loop fills an :class:`AcceptanceStats`; the sinks (Prometheus, MLflow, DuckDB, logs) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """Per-request speculation statistics (plain data; sinks such as metrics consume it)."""

    rounds: int = 0
    drafted: int = 0        # draft tokens proposed
    verified: int = 0       # draft tokens sent to the target
    accepted: int = 0       # draft tokens accepted
    emitted: int = 0        # tokens committed by rounds (accepted + recovered/bonus)
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0    # in the proposer's propose() (generate() only; prefill not included)
    verify_seconds: float = 0.0   # in the target's verify forwards after the prefill (a plain step's forward
                                  # when nothing is drafted)
    # per round (only when recording): drafted, verified, accepted, full_verify, raw confidence logits and
    # the survival the round was sized with
    round_log: list[dict] | None = None

    def observe(self, drafted: int, verified: int, accepted: int, emitted: int, full_verify: bool = True,
                confidence_logits: list[float] | None = None, survival: list[float] | None = None) -> None:
        if self.round_log is not None:
            self.round_log.append({"drafted": drafted, "verified": verified, "accepted": accepted,
                                   "full_verify": full_verify and verified == drafted,
                                   "confidence_logits": confidence_logits, "survival": survival})
        self.rounds += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        self.emitted += emitted
        for lst, n in ((self.verified_per_position, verified), (self.accepted_per_position, accepted)):
            if len(lst) < n:
                lst.extend([0] * (n - len(lst)))
            for i in range(n):
                lst[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, the recovered/bonus token included."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "verified": self.verified,
                "accepted": self.accepted, "emitted": self.emitted,
                "accepted_per_position": list(self.accepted_per_position),
                "verified_per_position": list(self.verified_per_position),
                "tau": round(self.tau, 4), "wall_seconds": round(self.wall_seconds, 4)}

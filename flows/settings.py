"""What the flows read from the environment, in one place (no Prefect import here).

The storage locations come from :class:`registry.cli.RegistrySettings` (``DSPARK_HOME``,
``DSPARK_MLFLOW_TRACKING_URI``, ``DSPARK_MLFLOW_ARTIFACTS``, ``DSPARK_WAREHOUSE``, ``DSPARK_LANDING``). On
top of those:

==============================  ===========================================================  ===========
variable                        meaning                                                      default
==============================  ===========================================================  ===========
``DSPARK_TARGET``               prepared target name or folder                               smollm2-135m-instruct
``DSPARK_FLOW_DTYPE``           dtype for training / eval / calibration / SPS                auto
``DSPARK_FLOW_DEVICE``          device the flows run the target and drafters on              cpu
``DSPARK_SERVER_URL``           serving base URL; after a promotion the flow POSTs           (none: no call)
                                ``{url}/admin/drafters/{domain}/reload``
``DSPARK_ADMIN_TOKEN``          bearer token for that call                                   (none)
``DSPARK_GATE_MIN_TAU_GAIN``    challenger tau must reach champion tau x (1 + gain)          0.02
``DSPARK_GATE_MAX_ECE``         bound on the worst per-position calibrated ECE               the budget's
``DSPARK_DRIFT_MARGIN``         retrain when live tau < champion tau x (1 - margin)          0.10
``DSPARK_DRIFT_WINDOW_HOURS``   how far back live acceptance is measured                     24
``DSPARK_DRIFT_MIN_ROUNDS``     fewer speculative rounds than this: no verdict               50
==============================  ===========================================================  ===========
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from registry.cli import RegistrySettings


def _float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class FlowSettings:
    registry: RegistrySettings
    target: str
    dtype: str
    device: str
    server_url: str | None
    admin_token: str | None
    min_tau_gain: float
    max_ece: float | None
    drift_margin: float
    drift_window_hours: float
    drift_min_rounds: int
    drift_max_live_ece: float | None = None   # drift too when serving's live ECE of the shipped calibration is above

    @property
    def home(self) -> Path:
        return self.registry.home

    @property
    def workdir(self) -> Path:
        """Where the flows keep snapshots, checkpoints, calibrations, SPS tables, reports and the journal."""
        return self.registry.home / "flows"

    @classmethod
    def from_env(cls) -> "FlowSettings":
        from dspark_core.model.target import DEFAULT_TARGET
        dtype = os.environ.get("DSPARK_FLOW_DTYPE", "auto")
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"DSPARK_FLOW_DTYPE={dtype!r}; use auto, float32 or bfloat16")
        return cls(registry=RegistrySettings.from_env(), target=os.environ.get("DSPARK_TARGET", DEFAULT_TARGET),
                   dtype=dtype, device=os.environ.get("DSPARK_FLOW_DEVICE", "cpu"), server_url=os.environ.get("DSPARK_SERVER_URL") or None,
                   admin_token=os.environ.get("DSPARK_ADMIN_TOKEN") or None,
                   min_tau_gain=_float("DSPARK_GATE_MIN_TAU_GAIN", 0.02), max_ece=_float("DSPARK_GATE_MAX_ECE", None),
                   drift_margin=_float("DSPARK_DRIFT_MARGIN", 0.10),
                   drift_window_hours=_float("DSPARK_DRIFT_WINDOW_HOURS", 24.0),
                   drift_min_rounds=int(_float("DSPARK_DRIFT_MIN_ROUNDS", 50)),
                   drift_max_live_ece=_float("DSPARK_DRIFT_MAX_LIVE_ECE", None))

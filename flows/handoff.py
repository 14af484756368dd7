"""Hand-off to serving: ask the serving admin API to reload a domain's drafter after a promotion, and read
a domain's live calibration state (for the drift check).

A failed call is reported, never raised: serving also polls the registry aliases, so a missed call
delays the swap but does not lose it; a drift check without the live ECE falls back to live tau.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import httpx


@dataclass(frozen=True)
class ReloadResult:
    """The reload call: whether serving accepted it, the URL called, the HTTP status when serving
    answered, and what went wrong when it did not accept."""

    ok: bool
    url: str
    status: int | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        """Only the fields that apply: ``ok`` and ``url``, then ``status`` and/or ``error``."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def notify_reload(server_url: str, domain: str, token: str | None, alias: str = "champion",
                  timeout: float = 5.0) -> ReloadResult:
    """POST ``{server_url}/admin/drafters/{domain}/reload`` with ``{"alias": alias}`` and a bearer token."""
    url = f"{server_url.rstrip('/')}/admin/drafters/{domain}/reload"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.post(url, json={"alias": alias}, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return ReloadResult(False, url, error=f"{type(e).__name__}: {e}")
    if resp.is_success:
        return ReloadResult(True, url, status=resp.status_code)
    return ReloadResult(False, url, status=resp.status_code, error=resp.text[:200])


@dataclass(frozen=True)
class LiveCalibrationState:
    """What serving's live calibrator saw for one domain: fully verified rounds in its window and the
    per-position ECE over them of the shipped calibration and of the one in use (``error`` when the call
    failed)."""

    rounds: int = 0
    ece_shipped: tuple[float, ...] = ()
    ece_live: tuple[float, ...] = ()
    error: str | None = None

    @property
    def worst_shipped(self) -> float | None:
        return max(self.ece_shipped) if self.ece_shipped else None

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}


def fetch_live_calibration(server_url: str, domain: str, token: str | None, timeout: float = 5.0) -> LiveCalibrationState:
    """GET ``{server_url}/admin/calibration/{domain}``; a failure is an ``error``, never an exception."""
    url = f"{server_url.rstrip('/')}/admin/calibration/{domain}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return LiveCalibrationState(error=f"{type(e).__name__}: {e}")
    if not resp.is_success:
        return LiveCalibrationState(error=f"HTTP {resp.status_code}: {resp.text[:200]}")
    live = (resp.json() or {}).get("live") or {}
    ece = live.get("ece") or {}
    return LiveCalibrationState(int(ece.get("rounds") or 0), tuple(ece.get("shipped") or ()), tuple(ece.get("live") or ()))

"""Hand-off to serving: ask the serving admin API to reload a domain's drafter after a promotion.

A failed call is reported, never raised: serving also polls the registry aliases, so a missed call
delays the swap but does not lose it.
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

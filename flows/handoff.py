"""Hand-off to serving: ask the serving admin API to reload a domain's drafter after a promotion.

A failed call is reported, never raised: serving also polls the registry aliases, so a missed call
delays the swap but does not lose it.
"""

from __future__ import annotations

import httpx


def notify_reload(server_url: str, domain: str, token: str | None, alias: str = "champion",
                  timeout: float = 5.0) -> dict:
    """POST ``{server_url}/admin/drafters/{domain}/reload`` with ``{"alias": alias}`` and a bearer token.
    Returns ``{"ok", "url", "status" | "error"}``."""
    url = f"{server_url.rstrip('/')}/admin/drafters/{domain}/reload"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.post(url, json={"alias": alias}, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return {"ok": False, "url": url, "error": f"{type(e).__name__}: {e}"}
    if resp.is_success:
        return {"ok": True, "url": url, "status": resp.status_code}
    return {"ok": False, "url": url, "status": resp.status_code, "error": resp.text[:200]}

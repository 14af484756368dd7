"""The admin API: drafter listing, reload (alias or pinned version), rollback, live calibration, audit log.

Bearer token from ``DSPARK_ADMIN_TOKEN`` (read by the CLI into the settings). No token configured: every
admin route answers 404 (the API is off). Missing or malformed credentials: 401 with
``WWW-Authenticate: Bearer``. A wrong token: 403.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from .drafters import DrafterNotFound
from .manager import ConflictError, UnknownDomain
from .protocol import APIError

_bearer = HTTPBearer(auto_error=False, description="DSPARK_ADMIN_TOKEN")


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alias: str | None = Field(None, min_length=1, max_length=64)
    version: int | None = Field(None, ge=1)
    reason: str = ""


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    registry: bool = False          # also move the registry's champion alias back
    reason: str = ""


def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    token = request.app.state.server.settings.admin_token
    if not token:
        raise APIError(404, "the admin API is disabled: start the server with DSPARK_ADMIN_TOKEN set",
                       type_="not_found_error", code="admin_disabled")
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise APIError(401, "admin endpoints need 'Authorization: Bearer <DSPARK_ADMIN_TOKEN>'",
                       type_="authentication_error", code="missing_token", headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(creds.credentials.encode(), token.encode()):
        raise APIError(403, "the admin token is not valid", type_="permission_error", code="invalid_token")
    return request.client.host if request.client else "unknown"


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


async def _manager_call(fn, *args, **kw):
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except UnknownDomain as e:
        raise APIError(404, str(e), type_="not_found_error", code="unknown_domain") from None
    except DrafterNotFound as e:
        raise APIError(404, str(e), type_="not_found_error", code="drafter_not_found") from None
    except ConflictError as e:
        raise APIError(409, str(e), type_="conflict_error", code="conflict") from None
    except (ValueError, OSError) as e:        # RegistryError, DrafterMismatchError, bad files
        raise APIError(400, f"{type(e).__name__}: {e}", code="load_failed") from None
    except TimeoutError as e:
        raise APIError(503, str(e), type_="server_error", code="engine_busy") from None


@router.get("/drafters")
async def list_drafters(request: Request) -> dict:
    s = request.app.state.server
    return {"policy": s.policy_info, "default_domain": s.default_domain, "domains": s.manager.describe(),
            "engine": s.engine.load(), "live_gate": s.engine.policy.describe()}


@router.post("/drafters/{domain}/reload")
async def reload_drafter(domain: str, request: Request, body: ReloadBody | None = None,
                         actor: str = Depends(require_admin)) -> dict:
    body = body or ReloadBody()
    if body.alias is not None and body.version is not None:
        raise APIError(400, "give either 'alias' or 'version', not both", param="alias")
    s = request.app.state.server
    return await _manager_call(s.manager.reload, domain, alias=body.alias, version=body.version,
                               actor="admin", reason=body.reason or f"admin from {actor}")


@router.post("/drafters/{domain}/rollback")
async def rollback_drafter(domain: str, request: Request, body: RollbackBody | None = None,
                           actor: str = Depends(require_admin)) -> dict:
    body = body or RollbackBody()
    s = request.app.state.server
    return await _manager_call(s.manager.rollback, domain, actor="admin", registry=body.registry,
                               reason=body.reason or f"admin from {actor}")


class CalibrationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = None     # turn the domain's live calibrator on or off
    reset: bool = False             # forget its window, back to the shipped calibration
    refit: bool = False             # refit on the window now (the guard still applies)


@router.get("/calibration/{domain}")
async def get_calibration(domain: str, request: Request) -> dict:
    """The live calibrator of the domain's drafter: temperatures and shifts in use (and shipped), window,
    per-position ECE over the window (raw, shipped, live), last refit, refusals."""
    return await _manager_call(request.app.state.server.manager.calibration, domain)


@router.post("/calibration/{domain}")
async def set_calibration(domain: str, request: Request, body: CalibrationBody | None = None,
                          actor: str = Depends(require_admin)) -> dict:
    body = body or CalibrationBody()
    return await _manager_call(request.app.state.server.manager.set_calibration, domain, enabled=body.enabled,
                               reset=body.reset, refit=body.refit, actor=f"admin from {actor}")


@router.post("/poll")
async def poll_now(request: Request) -> dict:
    """Poll the registry aliases now (what the background poller does every --poll-interval seconds)."""
    s = request.app.state.server
    return {"reloaded": await _manager_call(s.manager.poll_once)}


@router.get("/audit")
async def audit(request: Request, limit: int = 100) -> dict:
    return {"entries": request.app.state.server.audit.recent(max(1, min(limit, 1000)))}

"""Loaded drafters and where they come from: the MLflow registry (by alias or version) or a local folder.

A :class:`LoadedDrafter` is one domain's proposer object (shared by all of that domain's requests; each
request's state comes from ``proposer.start``), its calibration, its SPS profile and its identity, plus a
window of live acceptance that the canary reads. Sources return plain :class:`LoadedDrafter` objects and
never touch the engine: the :class:`~serving.manager.DrafterManager` decides when to swap.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Protocol

from dspark_core.calibration import Calibration
from dspark_core.data.traces import utc_now_iso
from dspark_core.drafters import build_proposer, read_checkpoint_meta
from dspark_core.engine.proposer import Proposer

from .calibrator import LiveCalibrator


class DrafterNotFound(LookupError):
    """No drafter registered under that alias / version / folder."""


class DrafterLoadError(ValueError):
    """A drafter folder or registry version that exists but cannot be loaded (missing or corrupt files,
    a checkpoint of another target, a malformed calibration); the message says why."""


class RollbackUnsupported(RuntimeError):
    """The source keeps no version history whose champion could be moved back (a folder, no source)."""


class AcceptanceWindow:
    """Accepted / drafted over the last ``size`` drafting rounds, plus lifetime totals. Thread-safe: the
    engine thread writes, admin handlers read."""

    def __init__(self, size: int):
        self._rounds: deque[tuple[int, int]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._drafted = self._accepted = 0          # running sums over the window (read every round)
        self.total_rounds = self.total_drafted = self.total_accepted = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        with self._lock:
            if len(self._rounds) == self._rounds.maxlen:
                old_d, old_a = self._rounds[0]
                self._drafted -= old_d
                self._accepted -= old_a
            self._rounds.append((drafted, accepted))
            self._drafted += drafted
            self._accepted += accepted
            self.total_rounds += 1
            self.total_drafted += drafted
            self.total_accepted += accepted

    def snapshot(self) -> dict:
        with self._lock:
            drafted, accepted, n = self._drafted, self._accepted, len(self._rounds)
        return {"rounds": n, "drafted": drafted, "accepted": accepted,
                "acceptance": round(accepted / drafted, 4) if drafted else None,
                "mean_accepted_per_round": round(accepted / n, 4) if n else None,
                "lifetime_rounds": self.total_rounds}

    def rate(self) -> float | None:
        return self.snapshot()["acceptance"]


@dataclass
class LoadedDrafter:
    domain: str
    proposer: Proposer
    label: str                            # e.g. "dspark-code:v3" (goes into trace records)
    version: int | None                   # registry version; None for an unversioned local folder
    source: str                           # "registry", "local", ...
    kind: str = ""
    calibrate: Callable | None = None     # raw confidence logits -> calibrated step probabilities
    sps: dict | None = None               # the SPS(B) profile registered with it
    window_size: int = 512
    calibration: Calibration | None = None   # the shipped calibration ``calibrate`` applies
    loaded_at: str = field(default_factory=utc_now_iso)
    window: AcceptanceWindow = field(init=False)
    live: "LiveCalibrator | None" = field(default=None, init=False)   # attached by the manager

    def __post_init__(self):
        self.window = AcceptanceWindow(self.window_size)

    def describe(self) -> dict:
        return {"label": self.label, "version": self.version, "source": self.source, "kind": self.kind,
                "loaded_at": self.loaded_at, "calibrated": self.calibrate is not None,
                "max_block": self.proposer.max_block, "live": self.window.snapshot(),
                "live_calibration": self.live.describe() if self.live is not None else None}


class DrafterSource(Protocol):
    """Where drafters come from. ``alias_version`` returns None when the source cannot be polled;
    ``rollback`` raises :class:`RollbackUnsupported` when the source has no registry behind it."""

    name: str

    def domains(self) -> list[str]: ...

    def alias_version(self, domain: str, alias: str) -> int | None: ...

    def load(self, domain: str, alias: str | None = None, version: int | None = None) -> LoadedDrafter: ...

    def rollback(self, domain: str, reason: str) -> int:
        """Move the registry's champion back; returns the version that is champion now."""
        ...


# 12 parameters: one folder's artifacts and identity, plus the source's build options passed straight through
def load_artifacts(domain: str, checkpoint: Path, calibration: dict | None, sps: dict | None, runner,
                   fingerprint: str, label: str, version: int | None, source: str,
                   window: int = 512, max_draft: int | None = None, lookup: bool = False) -> LoadedDrafter:
    """Build the proposer of one checkpoint folder (refuses a checkpoint made for another target);
    ``max_draft`` caps the draft tokens per round (never above a block drafter's trained block);
    ``lookup`` puts prompt lookup in front of it (a copy where the text repeats, the drafter elsewhere)."""
    try:
        return _build_loaded(domain, checkpoint, calibration, sps, runner, fingerprint, label, version, source,
                             window, max_draft, lookup)
    except DrafterNotFound:
        raise
    except Exception as e:            # a bad folder, whatever is wrong in it, is a load error, never a crash
        if isinstance(e, KeyError):
            reason = f"its files lack the field {e.args[0]!r}" if e.args else "its files lack a field"
        else:
            reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        # the reason names the folder, not where it sits on this server
        reason = reason.replace(str(Path(checkpoint).resolve()), Path(checkpoint).name)
        reason = reason.replace(str(checkpoint), Path(checkpoint).name)
        raise DrafterLoadError(f"the {label} drafter could not be loaded: {reason}") from e


def _build_loaded(domain: str, checkpoint: Path, calibration: dict | None, sps: dict | None, runner,
                  fingerprint: str, label: str, version: int | None, source: str,
                  window: int, max_draft: int | None, lookup: bool) -> LoadedDrafter:
    meta = read_checkpoint_meta(checkpoint)
    kind = meta["config"]["kind"]
    trained = meta["config"].get("block_size")
    block = min(max_draft, trained) if (max_draft and trained and kind != "eagle3") else max_draft
    proposer = build_proposer(kind, runner, fingerprint, checkpoint, block_size=block)
    if lookup:
        from dspark_core.drafters import LookupFirstProposer
        proposer = LookupFirstProposer(proposer)
    cal = None
    if calibration and calibration.get("temperatures"):
        known = {f.name for f in fields(Calibration)}         # tolerate extra keys a newer pipeline may add
        cal = Calibration.from_dict({k: v for k, v in calibration.items() if k in known})
    return LoadedDrafter(domain, proposer, label, version, source, kind, cal.apply if cal else None, sps, window,
                         calibration=cal)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


class RegistrySource:
    """Drafters from the MLflow registry (``dspark-drafter-<domain>``), downloaded once per version into
    ``cache_dir/<domain>/v<N>``."""

    name = "registry"

    def __init__(self, registry, cache_dir: Path, runner, fingerprint: str, window: int = 512,
                 max_draft: int | None = None, lookup: bool = False):
        self.registry, self.cache_dir = registry, Path(cache_dir)
        self.runner, self.fingerprint, self.window, self.max_draft = runner, fingerprint, window, max_draft
        self.lookup = lookup

    def domains(self) -> list[str]:
        return self.registry.domains()

    def alias_version(self, domain: str, alias: str) -> int | None:
        rv = self.registry.get_alias(domain, alias)
        return None if rv is None else rv.version

    def load(self, domain: str, alias: str | None = None, version: int | None = None) -> LoadedDrafter:
        if version is None:
            alias = alias or "champion"
            version = self.alias_version(domain, alias)
            if version is None:
                raise DrafterNotFound(f"dspark-drafter-{domain} has no alias {alias!r} in the registry")
        elif version not in {v.version for v in self.registry.versions(domain)}:
            raise DrafterNotFound(f"dspark-drafter-{domain} has no version {version}")
        dst = self.cache_dir / domain / f"v{version}"
        if not (dst / "registry.json").exists():
            self.registry.download(domain, version, dst)      # checks each file's registered sha256
        else:                                                  # a cached copy is checked again at every load
            self.registry.verify(domain, version, dst)
        return load_artifacts(domain, dst / "checkpoint", _read_json(dst / "calibration.json"),
                              _read_json(dst / "sps.json"), self.runner, self.fingerprint,
                              f"dspark-{domain}:v{version}", version, self.name, self.window, self.max_draft,
                              self.lookup)

    def rollback(self, domain: str, reason: str) -> int:
        """Move the registry's champion back (``DrafterRegistry.rollback``); returns the new champion.
        Nothing to go back to is a :class:`RollbackUnsupported` (a conflict with the state, not bad input)."""
        from registry.mlflow_registry import NothingToRollBack    # a registry source has MLflow loaded already
        try:
            return self.registry.rollback(domain, reason)
        except NothingToRollBack as e:
            raise RollbackUnsupported(str(e)) from None


class LocalSource:
    """Drafters from a folder: ``<dir>/<domain>/`` or ``<dir>/dspark-<domain>/`` holding a checkpoint
    (``config.json`` + ``model.safetensors``, directly or under ``checkpoint/``) and optionally
    ``calibration.json`` and ``sps.json``. Unversioned: a reload re-reads the folder."""

    name = "local"

    def __init__(self, root: Path, runner, fingerprint: str, window: int = 512, max_draft: int | None = None,
                 lookup: bool = False):
        self.root, self.runner, self.fingerprint, self.window = Path(root), runner, fingerprint, window
        self.max_draft, self.lookup = max_draft, lookup

    def _folder(self, domain: str) -> Path | None:
        for name in (domain, f"dspark-{domain}"):
            d = self.root / name
            if (d / "config.json").exists() or (d / "checkpoint" / "config.json").exists():
                return d
        return None

    def domains(self) -> list[str]:
        out = set()
        for d in self.root.iterdir() if self.root.is_dir() else []:
            name = d.name[len("dspark-"):] if d.name.startswith("dspark-") else d.name
            if self._folder(name) is not None:
                out.add(name)
        return sorted(out)

    def alias_version(self, domain: str, alias: str) -> int | None:
        return None

    def load(self, domain: str, alias: str | None = None, version: int | None = None) -> LoadedDrafter:
        if version is not None:
            raise DrafterNotFound(f"a local drafter folder has no versions (asked for version {version})")
        d = self._folder(domain)
        if d is None:
            raise DrafterNotFound(f"no drafter checkpoint for domain {domain!r} in the drafter folder "
                                  f"(<dir>/{domain}/ or <dir>/dspark-{domain}/)")
        ckpt = d / "checkpoint" if (d / "checkpoint" / "config.json").exists() else d
        return load_artifacts(domain, ckpt, _read_json(d / "calibration.json"), _read_json(d / "sps.json"),
                              self.runner, self.fingerprint, f"dspark-{domain}:local", None, self.name,
                              self.window, self.max_draft, self.lookup)

    def rollback(self, domain: str, reason: str) -> int:
        raise RollbackUnsupported(f"the {self.name} drafter source has no registry to roll back")


class NoSource:
    """No registry and no folder: every domain runs without speculation."""

    name = "none"

    def domains(self) -> list[str]:
        return []

    def alias_version(self, domain: str, alias: str) -> int | None:
        return None

    def load(self, domain: str, alias: str | None = None, version: int | None = None) -> LoadedDrafter:
        raise DrafterNotFound("no drafter source configured (give --drafter-dir or a registry)")

    def rollback(self, domain: str, reason: str) -> int:
        raise RollbackUnsupported(f"the {self.name} drafter source has no registry to roll back")

"""The MLflow model registry adapter for per-domain drafters, plus the pure promotion gate.

Each domain's drafter is the registered model ``dspark-drafter-<domain>``. One version holds:

- the pyfunc model (models-from-code, :mod:`registry.pyfunc_drafter`) with the artifacts
  ``checkpoint/`` (``model.safetensors`` + ``config.json`` only, no training state),
  ``calibration.json`` and ``sps.json``;
- the run that logged it: params, metrics and ``plots/``;
- version tags: ``domain``, ``target_fingerprint`` (required, from the checkpoint), ``trace_window``,
  ``trace_count``, ``code_version`` (``dspark_core.__version__`` + ``+g<git sha>``), ``drafter_kind``,
  ``run_key`` (the idempotency key) and the caller's tags.

Metrics: a scalar is logged at step 0. A list (per draft position) becomes a metric series with
``step = position`` (1-based), which the MLflow UI plots against position. :meth:`DrafterRegistry.version_info`
returns any key with a step above 0 as a list ordered by step. Metrics are linked to the logged model
too, so the UI's model page shows them.

Lifecycle uses aliases only, never the deprecated stages. Every new version gets ``challenger``.
``champion`` moves only through :meth:`DrafterRegistry.promote`, which records ``previous_champion``
so that :meth:`DrafterRegistry.rollback` can undo it. Flows first ask the pure function :func:`gate`.

Methods return plain data, never MLflow objects: ids and the frozen dataclasses
:class:`RegisteredVersion`, :class:`ModelVersionInfo` and :class:`PromotionRecord`. The fluent MLflow calls (``log_model``,
``load_model``) read process-global URIs. They run under a lock with this registry's URI, and the
caller's URIs are restored afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib.metadata import version as _pkg_version
from pathlib import Path

import mlflow
import mlflow.tracking._model_registry.utils as _registry_uri_state
import mlflow.tracking._tracking_service.utils as _tracking_uri_state
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

import dspark_core
from dspark_core.drafters import load_drafter, read_checkpoint_meta

PYFUNC_FILE = Path(__file__).with_name("pyfunc_drafter.py")
MODEL_PREFIX = "dspark-drafter-"
CHAMPION, CHALLENGER = "champion", "challenger"
#: metric keys read by :func:`gate`
TAU, ECE_CALIBRATED, LOSSLESS_FAILURES = "tau", "ece_calibrated", "lossless_failures"
_DOMAIN_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_URI_LOCK = threading.RLock()


class RegistryError(ValueError):
    """A registry request that cannot be honoured (bad checkpoint, unknown version, nothing to roll back)."""


class ArtifactIntegrityError(RegistryError):
    """A downloaded artifact whose sha256 differs from the one recorded when the version was registered."""


class NothingToRollBack(RegistryError):
    """The domain has no champion, or its champion no previous one to go back to."""


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: int
    run_id: str
    model_uri: str          # models:/<name>/<version>: a fixed version, unaffected by later alias moves


@dataclass(frozen=True)
class PromotionRecord:
    domain: str
    version: int
    previous_champion: int | None
    promoted_at: str        # ISO 8601 UTC
    reason: str


@dataclass(frozen=True)
class ModelVersionInfo:
    """Everything the registry holds about one version: where it is (name, number, run, URI), when it was
    created (epoch milliseconds), the aliases pointing at it, its version tags, and its run's params and
    metrics (a per-position series as a list ordered by position)."""

    name: str
    version: int
    run_id: str
    model_uri: str
    created: int
    aliases: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float | list[float]] = field(default_factory=dict)

    @property
    def domain(self) -> str:
        return self.name[len(MODEL_PREFIX):]

    @property
    def target_fingerprint(self) -> str | None:
        return self.tags.get("target_fingerprint")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelVersionInfo":
        return cls(**d)


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reasons: list[str] = field(default_factory=list)


def model_name(domain: str) -> str:
    if not _DOMAIN_RE.match(domain):
        raise RegistryError(f"invalid domain {domain!r}: use lowercase letters, digits, '-' or '_'")
    return MODEL_PREFIX + domain


def _worst(value) -> float:
    """Worst (largest) value of a scalar or per-position list."""
    return float(max(value)) if isinstance(value, (list, tuple)) else float(value)


def gate(challenger_metrics: dict, champion_metrics: dict | None, min_tau_gain: float = 0.02,
         max_ece: float = 0.03, first_needs_ece: bool = False) -> GateDecision:
    """Decide whether a challenger replaces the champion. Pure, with no MLflow inside.

    Reads ``tau`` (held-out mean tokens per round), ``ece_calibrated`` (a scalar or a per-position
    list; the worst position counts) and ``lossless_failures`` (optional, default 0):

    - a lossless-check failure always refuses (exactness is broken);
    - with no champion, promote: any drafter that passes the lossless check beats none (with
      ``first_needs_ece``, its worst calibrated ECE must also be ``<= max_ece``);
    - ``tau`` must reach ``champion tau * (1 + min_tau_gain)``;
    - the worst calibrated ECE must be ``<= max(champion's worst, max_ece)``: a champion already past
      the bound does not block a challenger that is no worse.

    ``reasons`` has one line per check, passed or failed. A missing ``tau`` raises ``KeyError``; a
    challenger without a calibrated ECE is refused when a champion exists.
    """
    reasons: list[str] = []
    failures = int(challenger_metrics.get(LOSSLESS_FAILURES, 0))
    lossless_ok = failures == 0
    reasons.append("lossless check passed" if lossless_ok else f"lossless check failed {failures} time(s)")
    tau = float(challenger_metrics[TAU])
    if champion_metrics is None:
        reasons.append(f"no champion yet: nothing to beat (challenger tau {tau:.3f})")
        if not first_needs_ece:
            return GateDecision(lossless_ok, reasons)
        ece = challenger_metrics.get(ECE_CALIBRATED)
        ece_ok = ece is not None and _worst(ece) <= max_ece
        reasons.append("challenger has no calibrated ECE" if ece is None else
                       f"calibrated ECE (worst position) {_worst(ece):.4f} {'<=' if ece_ok else '>'} bound {max_ece:.4f}")
        return GateDecision(lossless_ok and ece_ok, reasons)
    need = float(champion_metrics[TAU]) * (1 + min_tau_gain)
    tau_ok = tau >= need
    reasons.append(f"tau {tau:.3f} {'>=' if tau_ok else '<'} {need:.3f} (champion {float(champion_metrics[TAU]):.3f}"
                   f" x {1 + min_tau_gain:.3f})")
    if "tau_vs_champion_low" in challenger_metrics:      # informational: how well the prompts resolve the gain
        reasons.append(f"tau / champion {float(challenger_metrics['tau_vs_champion']):.3f}, 5-95 % "
                       f"{float(challenger_metrics['tau_vs_champion_low']):.3f}-"
                       f"{float(challenger_metrics['tau_vs_champion_high']):.3f} over paired resamples of the prompts")
    champ_ece = champion_metrics.get(ECE_CALIBRATED)
    bound = max(_worst(champ_ece), max_ece) if champ_ece is not None else max_ece
    if challenger_metrics.get(ECE_CALIBRATED) is None:
        ece_ok = False
        reasons.append("challenger has no calibrated ECE")
    else:
        ece = _worst(challenger_metrics[ECE_CALIBRATED])
        ece_ok = ece <= bound
        reasons.append(f"calibrated ECE (worst position) {ece:.4f} {'<=' if ece_ok else '>'} bound {bound:.4f}")
    return GateDecision(lossless_ok and tau_ok and ece_ok, reasons)


def code_version() -> str:
    """``dspark_core.__version__``, plus ``+g<sha>[.dirty]`` when this source tree is a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{dspark_core.__version__}+g{sha.replace('-', '.')}" if sha else dspark_core.__version__


def pip_requirements() -> list[str]:
    """Pinned to this environment: mlflow for the pyfunc, torch and safetensors for the weights. No
    inference (it costs seconds per log_model). ``dspark_core`` is not on PyPI; see the ``code_version`` tag."""
    pins = [f"{p}=={_pkg_version(p).split('+')[0]}" for p in ("torch", "safetensors")]   # drop local tags (+cpu)
    return [f"mlflow=={mlflow.__version__}", *pins]


def _tag_str(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@contextmanager
def _mlflow_uris(uri: str):
    """Point MLflow's fluent API at ``uri`` and restore the previous global and env state afterwards.
    ``mlflow.set_tracking_uri`` also writes env vars, so restoring through it would lose the caller's."""
    with _URI_LOCK:
        saved = (_tracking_uri_state._tracking_uri, _registry_uri_state._registry_uri,
                 {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")})
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        try:
            yield
        finally:
            _tracking_uri_state._tracking_uri, _registry_uri_state._registry_uri = saved[0], saved[1]
            for k, v in saved[2].items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


_MODEL_URI = re.compile(r"^models:/dspark-drafter-(?P<domain>[a-z0-9][a-z0-9_-]*)(?:@(?P<alias>[\w-]+)|/(?P<version>\d+))$")


def load_drafter_from_registry(model_uri: str, runner, target_fingerprint: str, tracking_uri: str | None = None):
    """The ``dspark_core`` drafter registered at ``model_uri`` (``models:/dspark-drafter-<domain>@<alias>``
    or ``.../<version>``) for ``runner``, without executing anything from the artifact store: the version's
    files are downloaded, checked against the sha256 digests recorded at registration
    (:class:`ArtifactIntegrityError` on a mismatch) and the checkpoint's weights read. A checkpoint made
    for another target raises ``DrafterMismatchError``. With no ``tracking_uri``, MLflow's current one.
    (``mlflow.pyfunc.load_model`` also works, but it runs the model's stored Python file.)"""
    m = _MODEL_URI.match(model_uri)
    if m is None:
        raise RegistryError(f"{model_uri!r} is not a drafter model URI; expected "
                            f"models:/dspark-drafter-<domain>@<alias> or models:/dspark-drafter-<domain>/<version>")
    reg = DrafterRegistry(tracking_uri or mlflow.get_tracking_uri())
    with tempfile.TemporaryDirectory(prefix="dspark-load-") as tmp:
        folder = reg.download(m["domain"], m["alias"] or int(m["version"]), Path(tmp) / "version")
        return load_drafter(folder / "checkpoint", runner, target_fingerprint)


class DrafterRegistry:
    """Registers, finds, promotes and rolls back the drafters of every domain in one MLflow store.

    ``tracking_uri`` also serves as the registry URI. Artifacts go to ``artifact_location`` when a new
    experiment is created. Without it, a ``sqlite:///.../mlflow.db`` store puts them in a
    ``mlartifacts`` folder next to the database, and a server store uses the server's default.
    The working directory's ``./mlruns`` is never used. The store is opened on first use (a new
    sqlite file then gets its tables); experiments are created only by :meth:`register`.
    """

    def __init__(self, tracking_uri: str, artifact_location: str | None = None, experiment: str = "dspark-drafters"):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        if artifact_location is None and tracking_uri.startswith("sqlite:///"):
            artifact_location = str(Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "mlartifacts")
        self.artifact_location = artifact_location

    @cached_property
    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    # ---- registration ---------------------------------------------------------------------------
    # Ten parameters: the domain and checkpoint, then keyword-only one per part of what a version records
    # (MLflow params, metrics, the calibration and SPS artifacts, engine-format exports, plots, tags) and its
    # idempotency key.
    def register(self, domain: str, checkpoint_dir: Path, *, params: dict, metrics: dict,
                 calibration: dict | None = None, sps: dict | None = None, exports: dict[str, Path] | None = None,
                 plots: list[Path] = (), tags: dict | None = None,
                 idempotency_key: str | None = None) -> RegisteredVersion:
        """Log a drafter in a new run, register it as the next version and point ``challenger`` at it.

        ``exports`` maps a format name (``speculators``, ``deepspec``) to the drafter exported in it
        (:func:`dspark_core.formats.export_drafter`); each travels as the model artifact of that name, so a
        vLLM or SGLang fleet pulls it straight from the registry.

        The checkpoint's ``config.json`` must carry a ``target_fingerprint``. A ``target_fingerprint``
        in ``tags`` or in ``calibration`` that differs from it raises ``RegistryError``.
        ``trace_window`` and ``trace_count`` come from ``tags``, else from the checkpoint metadata,
        else they are ``"unknown"``.

        With ``idempotency_key``, a version already tagged ``run_key=<key>`` is returned and nothing is
        logged. ``challenger`` is re-pointed at it only if it is still the newest version, which covers
        a crash between registering and setting the alias. Version tags are written when the version
        is created, so a crash cannot leave a registered version without its key.
        """
        name = model_name(domain)
        if idempotency_key is not None:
            found = self.find_version(domain, "run_key", idempotency_key)
            if found is not None:
                if found.version == max(v.version for v in self.versions(domain)):
                    self.client.set_registered_model_alias(name, CHALLENGER, str(found.version))
                return found
        checkpoint_dir = Path(checkpoint_dir)
        meta = read_checkpoint_meta(checkpoint_dir)
        version_tags = _version_tags(domain, checkpoint_dir, meta, tags or {}, calibration, idempotency_key)
        points = _metric_points(metrics)
        with tempfile.TemporaryDirectory(prefix="dspark-register-") as tmp, _mlflow_uris(self.tracking_uri):
            artifacts = _stage(checkpoint_dir, Path(tmp), calibration, sps, exports or {})
            version_tags[INTEGRITY_TAG] = json.dumps(file_digests(Path(tmp)), sort_keys=True, separators=(",", ":"))
            run_tags = {"domain": domain, **({"run_key": idempotency_key} if idempotency_key else {})}
            run_name = f"{domain}-{time.strftime('%Y%m%d-%H%M%S')}"
            with mlflow.start_run(experiment_id=self._experiment_id(), run_name=run_name, tags=run_tags,
                                  nested=mlflow.active_run() is not None) as run:
                mlflow.log_params({**{f"drafter.{k}": _tag_str(v) for k, v in meta["config"].items()},
                                   **{k: _tag_str(v) for k, v in params.items()}})
                info = mlflow.pyfunc.log_model(name="drafter", python_model=str(PYFUNC_FILE), artifacts=artifacts,
                                               pip_requirements=pip_requirements())
                ts = int(time.time() * 1000)
                self.client.log_batch(run.info.run_id, metrics=[Metric(k, v, ts, step, model_id=info.model_id)
                                                                for k, v, step in points])
                for plot in plots:
                    mlflow.log_artifact(str(plot), artifact_path="plots")
                mv = mlflow.register_model(info.model_uri, name, tags=version_tags)
        self.client.set_registered_model_tag(name, "domain", domain)
        self.client.set_registered_model_alias(name, CHALLENGER, str(mv.version))
        return RegisteredVersion(name, int(mv.version), run.info.run_id, f"models:/{name}/{mv.version}")

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            return self.client.create_experiment(self.experiment, artifact_location=self.artifact_location)
        if exp.lifecycle_stage != "active":
            raise RegistryError(f"experiment {self.experiment!r} is deleted; restore it or use another experiment name")
        return exp.experiment_id

    # ---- lookups --------------------------------------------------------------------------------
    def find_version(self, domain: str, tag_key: str, tag_value: str) -> RegisteredVersion | None:
        """The newest version of the domain's model whose tag ``tag_key`` equals ``tag_value``, or None."""
        if "`" in tag_key or "'" in tag_value:
            raise RegistryError("tag keys may not contain '`' and tag values may not contain \"'\"")
        hits = self.client.search_model_versions(f"name = '{model_name(domain)}' and tag.`{tag_key}` = '{tag_value}'")
        return _plain(max(hits, key=lambda v: int(v.version))) if hits else None

    def versions(self, domain: str) -> list[RegisteredVersion]:
        """All versions of the domain's model, oldest first ([] if the model does not exist)."""
        hits = self.client.search_model_versions(f"name = '{model_name(domain)}'")
        return sorted((_plain(v) for v in hits), key=lambda v: v.version)

    def domains(self) -> list[str]:
        """Domains that have a registered drafter model."""
        models = self.client.search_registered_models(filter_string=f"name LIKE '{MODEL_PREFIX}%'")
        return sorted(m.name[len(MODEL_PREFIX):] for m in models)

    def get_alias(self, domain: str, alias: str) -> RegisteredVersion | None:
        mv = self._by_alias(domain, alias)
        return None if mv is None else _plain(mv)

    def _by_alias(self, domain: str, alias: str):
        try:
            return self.client.get_model_version_by_alias(model_name(domain), alias)
        except MlflowException as e:     # no such model, or no such alias
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def champion(self, domain: str) -> RegisteredVersion | None:
        return self.get_alias(domain, CHAMPION)

    def version_info(self, domain: str, version: int) -> ModelVersionInfo:
        """Tags, aliases, params and metrics (per-position series as lists) of one version."""
        return self._info(self._get(domain, version))

    def alias_info(self, domain: str, alias: str) -> ModelVersionInfo | None:
        """:meth:`version_info` of the version ``alias`` points at, or None when there is none."""
        mv = self._by_alias(domain, alias)
        return None if mv is None else self._info(mv)

    def champion_info(self, domain: str) -> ModelVersionInfo | None:
        return self.alias_info(domain, CHAMPION)

    def _info(self, mv) -> ModelVersionInfo:
        run = self.client.get_run(mv.run_id)
        metrics = {}
        for key, last in run.data.metrics.items():
            hist = sorted(self.client.get_metric_history(mv.run_id, key), key=lambda m: m.step)
            metrics[key] = [m.value for m in hist] if any(m.step > 0 for m in hist) else last
        return ModelVersionInfo(name=mv.name, version=int(mv.version), run_id=mv.run_id,
                                model_uri=f"models:/{mv.name}/{mv.version}", created=mv.creation_timestamp,
                                aliases=sorted(mv.aliases), tags=dict(mv.tags), params=dict(run.data.params),
                                metrics=metrics)

    def verify(self, domain: str, version: int, folder: Path) -> bool:
        """Check a downloaded version's files against the sha256 digests recorded in the tracking store at
        registration (:data:`INTEGRITY_TAG`); raises :class:`ArtifactIntegrityError` on any mismatch or
        missing file. False (and nothing checked) for a version registered before digests were recorded."""
        rv = self._get(domain, version)
        return verify_artifacts(Path(folder), rv.tags, f"{rv.name} v{rv.version}")

    def _get(self, domain: str, version: int):
        try:
            return self.client.get_model_version(model_name(domain), str(int(version)))
        except MlflowException as e:
            raise RegistryError(f"{model_name(domain)} has no version {version}") from e

    # ---- aliases and promotion ------------------------------------------------------------------
    def set_alias(self, domain: str, alias: str, version: int) -> RegisteredVersion:
        """Point ``alias`` at ``version``. ``champion`` is refused: use :meth:`promote` so the history is kept."""
        if alias == CHAMPION:
            raise RegistryError("champion moves only through promote(), which records the previous champion")
        mv = self._get(domain, version)
        self.client.set_registered_model_alias(mv.name, alias, str(mv.version))
        return _plain(mv)

    def promote(self, domain: str, version: int, reason: str) -> PromotionRecord:
        """Move ``champion`` to ``version``. The version gets the tags ``previous_champion``,
        ``promoted_at`` and ``promotion_reason``, written before the alias moves so a crash between
        the two is repaired by calling again. Promoting the current champion changes nothing."""
        mv, current = self._get(domain, version), self.champion(domain)
        if current is not None and current.version == int(version):
            prev = mv.tags.get("previous_champion") or None
            return PromotionRecord(domain, current.version, int(prev) if prev else None,
                                   mv.tags.get("promoted_at", ""), mv.tags.get("promotion_reason", ""))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        prev = current.version if current else None
        for k, v in (("previous_champion", "" if prev is None else str(prev)), ("promoted_at", now),
                     ("promotion_reason", reason)):
            self.client.set_model_version_tag(mv.name, str(mv.version), k, v)
        self.client.set_registered_model_alias(mv.name, CHAMPION, str(mv.version))
        return PromotionRecord(domain, int(mv.version), prev, now, reason)

    def rollback(self, domain: str, reason: str = "") -> int:
        """Move ``champion`` back to the version recorded as ``previous_champion`` of the current one; tag
        the demoted version ``rolled_back_at``. Repeated rollbacks walk further back. Returns the new champion."""
        current = self.champion(domain)
        if current is None:
            raise NothingToRollBack(f"{model_name(domain)} has no champion to roll back")
        prev = self._get(domain, current.version).tags.get("previous_champion")
        if not prev:
            raise NothingToRollBack(f"{model_name(domain)} v{current.version} has no previous champion recorded")
        target = self._get(domain, int(prev))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.client.set_model_version_tag(current.name, str(current.version), "rolled_back_at", now)
        if reason:
            self.client.set_model_version_tag(current.name, str(current.version), "rollback_reason", reason)
        self.client.set_registered_model_alias(current.name, CHAMPION, str(target.version))
        return int(target.version)

    # ---- artifacts ------------------------------------------------------------------------------
    def download(self, domain: str, alias_or_version: str | int, dst: Path) -> Path:
        """Fetch a version's artifacts into ``dst`` (replaced whole, through a sibling temp folder) and
        return ``dst``: ``checkpoint/`` (model.safetensors, config.json), ``calibration.json``,
        ``sps.json`` and the engine-format exports such as ``speculators/`` (where registered), and
        ``registry.json`` (name, version, run id, tags). An alias is resolved once, so the files are all
        from one version even if the alias moves meanwhile."""
        key = str(alias_or_version)
        rv = self._get(domain, int(key)) if key.isdigit() else self._by_alias(domain, key)
        if rv is None:
            raise RegistryError(f"{model_name(domain)} has no alias {key!r}")
        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        root = self.client.get_model_version_download_uri(rv.name, str(rv.version)).rstrip("/")
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=f"{root}/artifacts", dst_path=str(tmp),
                                                tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
            got = tmp / "artifacts"
            verify_artifacts(got, rv.tags, f"{rv.name} v{rv.version}")
            (got / "registry.json").write_text(json.dumps(
                {"name": rv.name, "version": int(rv.version), "run_id": rv.run_id, "tags": dict(rv.tags)}, indent=2))
            if dst.exists():
                shutil.rmtree(dst)
            got.replace(dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dst


def _version_tags(domain: str, checkpoint_dir: Path, meta: dict, tags: dict, calibration: dict | None,
              key: str | None) -> dict[str, str]:
    fp = meta.get("target_fingerprint")
    if not isinstance(fp, str) or not fp:
        raise RegistryError(f"{checkpoint_dir / 'config.json'} has no target_fingerprint: a drafter is only valid "
                            f"for the target it was trained against; save it with save_drafter(model, folder, "
                            f"target_fingerprint)")
    for where, other in (("tags", tags.get("target_fingerprint")),
                         ("calibration", (calibration or {}).get("target_fingerprint"))):
        if other and other != fp:
            raise RegistryError(f"target fingerprint in {where} ({str(other)[:12]}) differs from the "
                                f"checkpoint's ({fp[:12]})")
    out = {"trace_window": _tag_str(meta.get("trace_window", "unknown")),
           "trace_count": _tag_str(meta.get("trace_count", "unknown")),
           "code_version": code_version(), "drafter_kind": str(meta["config"].get("kind", ""))}
    out |= {k: _tag_str(v) for k, v in tags.items()}
    out |= {"domain": domain, "target_fingerprint": fp}
    return out | ({"run_key": key} if key is not None else {})


def _plain(mv) -> RegisteredVersion:
    return RegisteredVersion(mv.name, int(mv.version), mv.run_id, f"models:/{mv.name}/{mv.version}")


INTEGRITY_TAG = "artifact_sha256"      # version tag: {relative path: sha256} of every registered artifact file


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (POSIX separators, sorted)."""
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(Path(root).rglob("*")) if p.is_file()}


def verify_artifacts(folder: Path, tags: dict, what: str) -> bool:
    """Check the files under ``folder`` against the digests in ``tags[INTEGRITY_TAG]``: every recorded
    file must be there with its recorded sha256. Raises :class:`ArtifactIntegrityError` naming the first
    file that differs; returns False when ``tags`` record no digests (an older version), True when all
    match."""
    raw = (tags or {}).get(INTEGRITY_TAG)
    if not raw:
        return False
    try:
        expected = json.loads(raw)
    except ValueError:
        raise ArtifactIntegrityError(f"{what}: its {INTEGRITY_TAG} tag is not valid JSON") from None
    for rel, digest in sorted(expected.items()):
        path = Path(folder) / rel
        if not path.is_file():
            raise ArtifactIntegrityError(f"{what}: the registered artifact {rel} is missing from the artifact "
                                         f"store")
        if _sha256(path) != digest:
            raise ArtifactIntegrityError(f"{what}: the artifact {rel} differs from the file registered (sha256 "
                                         f"mismatch); the artifact store was changed after registration")
    return True


def _stage(checkpoint_dir: Path, tmp: Path, calibration: dict | None, sps: dict | None,
           exports: dict[str, Path]) -> dict[str, str]:
    """Copy the artifacts under fixed names; of the checkpoint only the weights and config travel."""
    (tmp / "checkpoint").mkdir()
    for f in ("model.safetensors", "config.json"):
        shutil.copy2(checkpoint_dir / f, tmp / "checkpoint" / f)
    artifacts = {"checkpoint": str(tmp / "checkpoint")}
    for key, data in (("calibration", calibration), ("sps", sps)):
        if data is not None:
            (tmp / f"{key}.json").write_text(json.dumps(data, indent=2))
            artifacts[key] = str(tmp / f"{key}.json")
    for fmt, folder in exports.items():
        if fmt in artifacts:
            raise RegistryError(f"an export cannot be named {fmt!r}: that artifact name is taken")
        shutil.copytree(folder, tmp / fmt)
        artifacts[fmt] = str(tmp / fmt)
    return artifacts


def _metric_points(metrics: dict) -> list[tuple[str, float, int]]:
    """(key, value, step): scalars at step 0, lists at step = position (1-based). Checked before logging."""
    out = []
    for key, value in metrics.items():
        for step, v in list(enumerate(value, 1)) if isinstance(value, (list, tuple)) else [(0, value)]:
            if not isinstance(v, (int, float)):            # bools count as 0 / 1
                raise RegistryError(f"metric {key!r} must be a number or a list of numbers, got {v!r}")
            out.append((key, float(v), step))
    return out

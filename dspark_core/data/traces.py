"""The trace record: one generated completion, as serving writes it and the pipeline reads it.

Defined once, here. Serving appends records to JSONL files in the landing folder
(``<home>/landing/<domain>/<name>.jsonl``); ``dspark traces bootstrap`` writes the same records from
offline prompts; the ingest flow and the training loop read them back with :func:`read_jsonl` (strict)
or :func:`read_jsonl_lenient` (collects bad lines instead of stopping).

Contract of a record (schema version :data:`TRACE_SCHEMA_VERSION`):

- ``prompt_id`` is :func:`prompt_id_of` of the prompt *text* (sha1, first 16 hex chars), so the same
  prompt gets the same id in every file and the train / held-out split can be keyed on it.
- ``prompt_ids`` are the token ids fed to the target (chat template included), ``completion_ids`` the
  ids it generated (stop token included when it stopped).
- ``rounds`` holds one :class:`RoundStat` per speculative round, and is empty when no speculation ran
  (bootstrap traces, plain serving). ``accepted <= verified <= drafted`` in every round; a round with
  ``full_verify`` verified its whole drafted block (shadow / uncensored label), so ``verified == drafted``.
- ``calibration`` (optional; None when absent, so files from before it still read) names the confidence
  calibration that sized the rounds: ``source`` shipped / live / none, the live refit's ``version``, the
  per-position ``temperatures`` and ``shifts``, and (optional) ``request_prior``: the pseudo-labels that
  shrank the request's own confidence offset toward that calibration (0 or absent: no offset).

Every validation failure raises :class:`TraceFormatError` whose message starts with ``where`` (for a
file ``path:line``) and names the offending field. Nothing here reads the environment: the data home
is passed in.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

from dspark_core.data.limits import INT32_MAX

TRACE_SCHEMA_VERSION = 1
SOURCES = ("bootstrap", "serving", "import")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
OPTIONAL_FIELDS = ("calibration",)          # a record without them (an older writer) reads as None
CALIBRATION_KEYS = ("source", "version", "temperatures", "shifts")
CALIBRATION_OPTIONAL_KEYS = ("request_prior",)     # absent in records from writers before it
CALIBRATION_SOURCES = ("shipped", "live", "none")
_MAX_CALIBRATION_POSITIONS = 256
_DOMAIN_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_PROMPT_ID_RE = re.compile(r"^[0-9a-f]{16}$")


class TraceFormatError(ValueError):
    """A trace record or trace file line is invalid; the message names where and which field."""


def is_domain_name(name) -> bool:
    """Whether ``name`` can name a domain: lowercase ``[a-z0-9_-]``, starting with a letter or digit."""
    return isinstance(name, str) and bool(_DOMAIN_RE.match(name))


def prompt_id_of(text: str) -> str:
    """The stable id of a prompt text: sha1 of its UTF-8 bytes, first 16 hex chars."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def utc_now_iso() -> str:
    """The current time as ISO-8601 UTC with milliseconds, e.g. ``2025-01-31T12:00:00.123Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def landing_dir(home: Path) -> Path:
    """The landing folder for trace files: ``<home>/landing`` (one subfolder per domain)."""
    return Path(home) / "landing"


def landing_file(home: Path, domain: str, name: str) -> Path:
    """``<home>/landing/<domain>/<name>.jsonl``; ``domain`` must be a simple lowercase name."""
    check_domain(domain)
    return landing_dir(home) / domain / f"{name}.jsonl"


def check_domain(domain: str, where: str = "domain") -> str:
    if not isinstance(domain, str) or not _DOMAIN_RE.match(domain):
        raise TraceFormatError(f"{where}: field 'domain' must be a lowercase name of [a-z0-9_-], got {domain!r}")
    return domain


# ------------------------------------------------------------------------------ validation helpers
def _check_calibration(where: str, cal) -> None:
    """``calibration``: which per-position temperatures (and shifts) sized the request's rounds; ``source``
    is "shipped" (the drafter's registered calibration), "live" (the server's refit, ``version`` counting
    its accepted refits) or "none"."""
    if not isinstance(cal, dict):
        _fail(where, "calibration", f"must be an object or null, got {type(cal).__name__}")
    if not set(CALIBRATION_KEYS) <= set(cal) <= set(CALIBRATION_KEYS + CALIBRATION_OPTIONAL_KEYS):
        _fail(where, "calibration", f"must have the keys {', '.join(CALIBRATION_KEYS)} (and optionally "
              f"{', '.join(CALIBRATION_OPTIONAL_KEYS)}), got {', '.join(sorted(map(str, cal)))}")
    if cal["source"] not in CALIBRATION_SOURCES:
        _fail(where, "calibration.source", f"must be one of {', '.join(CALIBRATION_SOURCES)}, got {cal['source']!r}")
    _check_int(where, "calibration.version", cal["version"], 0)
    prior = cal.get("request_prior", 0.0)
    if not _is_num(prior) or not math.isfinite(prior) or prior < 0:
        _fail(where, "calibration.request_prior", f"must be a finite number >= 0, got {prior!r}")
    for name, positive in (("temperatures", True), ("shifts", False)):
        v = cal[name]
        if not isinstance(v, list) or len(v) > _MAX_CALIBRATION_POSITIONS:
            _fail(where, f"calibration.{name}", f"must be a list of at most {_MAX_CALIBRATION_POSITIONS} numbers")
        for x in v:
            if not _is_num(x) or not math.isfinite(x) or (positive and x <= 0):
                _fail(where, f"calibration.{name}", f"must hold finite{' positive' if positive else ''} numbers, "
                      f"got {x!r}")


def _fail(where: str, fieldname: str, why: str) -> None:
    raise TraceFormatError(f"{where}: field '{fieldname}' {why}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _check_int(where: str, name: str, v, minimum: int | None = 0, maximum: int = INT32_MAX) -> None:
    if not _is_int(v):
        _fail(where, name, f"must be an integer, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        _fail(where, name, f"must be >= {minimum}, got {v}")
    if v > maximum:
        _fail(where, name, f"must be <= {maximum} (the warehouse's INTEGER range), got {v}")


def _check_str(where: str, name: str, v, nonempty: bool = True) -> None:
    if not isinstance(v, str):
        _fail(where, name, f"must be a string, got {type(v).__name__} {v!r}")
    if nonempty and not v:
        _fail(where, name, "must not be empty")


def _check_ids(where: str, name: str, v, nonempty: bool) -> None:
    if not isinstance(v, list):
        _fail(where, name, f"must be a list of token ids, got {type(v).__name__}")
    if nonempty and not v:
        _fail(where, name, "must not be empty")
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t <= INT32_MAX:
            _fail(where, f"{name}[{i}]", f"must be a token id in [0, {INT32_MAX}] (the warehouse's INTEGER "
                  f"range), got {t!r}")


def _check_sampling(where: str, v) -> None:
    if not isinstance(v, dict):
        _fail(where, "sampling", f"must be an object, got {type(v).__name__}")
    missing = [k for k in SAMPLING_KEYS if k not in v]
    extra = sorted(set(v) - set(SAMPLING_KEYS))
    if missing:
        _fail(where, f"sampling.{missing[0]}", "is missing")
    if extra:
        _fail(where, f"sampling.{extra[0]}", f"is not a known sampling key ({', '.join(SAMPLING_KEYS)})")
    if not _is_num(v["temperature"]) or not 0 <= v["temperature"] < math.inf:
        _fail(where, "sampling.temperature", f"must be a finite number >= 0, got {v['temperature']!r}")
    if not _is_num(v["top_p"]) or not 0 < v["top_p"] <= 1:
        _fail(where, "sampling.top_p", f"must be a number in (0, 1], got {v['top_p']!r}")
    _check_int(where, "sampling.top_k", v["top_k"], 0)
    _check_int(where, "sampling.max_new_tokens", v["max_new_tokens"], 1)


def _check_timestamp(where: str, v) -> None:
    _check_str(where, "timestamp", v)
    try:
        ts = datetime.fromisoformat(v)
    except ValueError:
        _fail(where, "timestamp", f"must be ISO-8601, got {v!r}")
    if ts.utcoffset() is None or ts.utcoffset().total_seconds() != 0:
        _fail(where, "timestamp", f"must be UTC (end in Z or +00:00), got {v!r}")


# ------------------------------------------------------------------------------------ the record
@dataclass(frozen=True)
class RoundStat:
    """One speculative round: tokens drafted, verified by the target, and accepted."""

    drafted: int
    verified: int
    accepted: int
    full_verify: bool      # the whole drafted block was verified (uncensored acceptance label)

    def __post_init__(self):
        self.validate("RoundStat")

    def validate(self, where: str, prefix: str = "") -> None:
        for name in ("drafted", "verified", "accepted"):
            _check_int(where, prefix + name, getattr(self, name), 0)
        if not isinstance(self.full_verify, bool):
            _fail(where, prefix + "full_verify", f"must be true or false, got {self.full_verify!r}")
        if self.verified > self.drafted:
            _fail(where, prefix + "verified", f"({self.verified}) must be <= drafted ({self.drafted})")
        if self.accepted > self.verified:
            _fail(where, prefix + "accepted", f"({self.accepted}) must be <= verified ({self.verified})")
        if self.full_verify and self.verified != self.drafted:
            _fail(where, prefix + "full_verify", f"is true but verified ({self.verified}) != drafted ({self.drafted})")

    @classmethod
    def from_dict(cls, d, where: str, prefix: str = "rounds[?].") -> "RoundStat":
        if not isinstance(d, dict):
            _fail(where, prefix.rstrip("."), f"must be an object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for name in names:
            if name not in d:
                _fail(where, prefix + name, "is missing")
        extra = sorted(set(d) - set(names))
        if extra:
            _fail(where, prefix + extra[0], "is not a RoundStat field")
        obj = object.__new__(cls)
        for name in names:
            object.__setattr__(obj, name, d[name])
        obj.validate(where, prefix)
        return obj


@dataclass(frozen=True)
class TraceRecord:
    """One request's trace; see the module docstring for the contract. Validated on construction."""

    request_id: str
    timestamp: str                      # ISO-8601 UTC
    domain: str
    prompt_id: str                      # prompt_id_of(prompt text)
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling: dict                      # temperature, top_p, top_k, max_new_tokens
    target_fingerprint: str
    drafter: str | None                 # e.g. "dspark-code:v3"; None when no drafter ran
    rounds: list[RoundStat]             # empty when no speculation ran
    source: str                         # "bootstrap", "serving" or "import" (landed chat logs)
    finish_reason: str                  # "stop", "length", ...
    schema_version: int = TRACE_SCHEMA_VERSION
    calibration: dict | None = None     # the confidence calibration that sized the rounds (optional)

    def __post_init__(self):
        self.validate("TraceRecord")

    def validate(self, where: str) -> None:
        """Raise :class:`TraceFormatError` naming ``where`` and the field if anything is off."""
        if not _is_int(self.schema_version) or self.schema_version != TRACE_SCHEMA_VERSION:
            _fail(where, "schema_version", f"is {self.schema_version!r}; this version of dspark reads "
                  f"schema_version {TRACE_SCHEMA_VERSION}")
        _check_str(where, "request_id", self.request_id)
        _check_timestamp(where, self.timestamp)
        if not isinstance(self.domain, str) or not _DOMAIN_RE.match(self.domain):
            _fail(where, "domain", f"must be a lowercase name of [a-z0-9_-], got {self.domain!r}")
        if not isinstance(self.prompt_id, str) or not _PROMPT_ID_RE.match(self.prompt_id):
            _fail(where, "prompt_id", f"must be 16 lowercase hex chars, got {self.prompt_id!r}")
        _check_ids(where, "prompt_ids", self.prompt_ids, nonempty=True)
        _check_ids(where, "completion_ids", self.completion_ids, nonempty=False)
        _check_sampling(where, self.sampling)
        _check_str(where, "target_fingerprint", self.target_fingerprint)
        if self.drafter is not None:
            _check_str(where, "drafter", self.drafter)
        if not isinstance(self.rounds, list):
            _fail(where, "rounds", f"must be a list, got {type(self.rounds).__name__}")
        for i, r in enumerate(self.rounds):
            if not isinstance(r, RoundStat):
                _fail(where, f"rounds[{i}]", f"must be a RoundStat, got {type(r).__name__}")
        if self.source not in SOURCES:
            _fail(where, "source", f"must be one of {', '.join(SOURCES)}, got {self.source!r}")
        _check_str(where, "finish_reason", self.finish_reason)
        if self.calibration is not None:
            _check_calibration(where, self.calibration)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"schema_version": d.pop("schema_version"), **d}

    def to_json(self) -> str:
        """One compact JSON line (no newline), ``schema_version`` first."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d, where: str) -> "TraceRecord":
        """Build and validate a record from parsed JSON; errors name ``where`` and the field."""
        if not isinstance(d, dict):
            raise TraceFormatError(f"{where}: a trace record must be a JSON object, got {type(d).__name__}")
        if "schema_version" not in d:
            _fail(where, "schema_version", "is missing")
        if d["schema_version"] != TRACE_SCHEMA_VERSION or not _is_int(d["schema_version"]):
            _fail(where, "schema_version", f"is {d['schema_version']!r}; this version of dspark reads "
                  f"schema_version {TRACE_SCHEMA_VERSION}")
        names = [f.name for f in fields(cls)]
        for name in names:
            if name not in d and name not in OPTIONAL_FIELDS:
                _fail(where, name, "is missing")
        extra = sorted(set(d) - set(names))
        if extra:
            _fail(where, extra[0], "is not a trace record field")
        rounds = d["rounds"]
        if not isinstance(rounds, list):
            _fail(where, "rounds", f"must be a list, got {type(rounds).__name__}")
        kw = dict(d)
        kw["rounds"] = [RoundStat.from_dict(r, where, f"rounds[{i}].") for i, r in enumerate(rounds)]
        obj = object.__new__(cls)
        for name in names:
            object.__setattr__(obj, name, kw.get(name))
        obj.validate(where)
        return obj


# ------------------------------------------------------------------------------------ JSONL files
def write_jsonl(records: Iterable[TraceRecord], path: Path, append: bool = True) -> int:
    """Write records one per line (append by default), flushing each line; returns the count.

    Each line goes out in one write followed by a flush, so a crash loses at most the line in flight;
    a torn last line is what :func:`repair_torn_tail` removes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for rec in records:
            if not isinstance(rec, TraceRecord):
                raise TypeError(f"write_jsonl takes TraceRecord objects, got {type(rec).__name__}")
            f.write(rec.to_json() + "\n")
            f.flush()
            n += 1
    return n


def _parse_line(line: str, where: str) -> TraceRecord:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    return TraceRecord.from_dict(d, where)


def read_jsonl(path: Path) -> Iterator[tuple[int, TraceRecord]]:
    """Yield ``(lineno, record)`` for each non-blank line; the first bad line raises
    :class:`TraceFormatError` with ``path:line: reason``."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, _parse_line(line, f"{path}:{lineno}")


def read_jsonl_lenient(path: Path) -> tuple[list[TraceRecord], list[tuple[int, str]]]:
    """All valid records of a file plus ``(lineno, reason)`` for every bad line (for ingest)."""
    path = Path(path)
    records, errors = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(_parse_line(line, f"{path}:{lineno}"))
            except TraceFormatError as e:
                errors.append((lineno, str(e)))
    return records, errors


def repair_torn_tail(path: Path) -> bool:
    """Cut an unterminated last line (a write torn by a crash) so appends start on a fresh line.

    Only a last line without its newline is removed; returns whether anything was cut.
    """
    path = Path(path)
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    with path.open("r+b") as f:
        f.truncate(keep)
    return True

"""The DuckDB trace warehouse: idempotent ingest of landed trace files, and plain-data queries.

Native ``duckdb`` API rather than SQLAlchemy + duckdb-engine: duckdb-engine 0.17 predates DuckDB 2.0
(streaming results, removed relation methods), the tables here need DuckDB types that a
PostgreSQL-derived dialect does not model (``INTEGER[]``, ``STRUCT``), and bulk ingest is simpler and
faster natively (one Arrow batch per ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``). Only
``registry/`` imports duckdb, and every query returns plain Python data: records, frozen dataclasses
(:class:`IngestSummary`, :class:`WarehouseTotals`, :class:`LiveAcceptance`) or table rows.

Tables (created on open, idempotently):

- ``traces``: one column per :class:`~dspark_core.data.traces.TraceRecord` field (token ids ``INTEGER[]``,
  ``timestamp`` a ``TIMESTAMP`` in UTC, ``sampling`` a ``STRUCT``, ``rounds`` a ``LIST`` of ``STRUCT``, so
  SQL can aggregate acceptance without parsing JSON), plus ``ingested_at``, ``source_file`` and
  ``source_line``. Primary key ``request_id``: a request is one record wherever it lands, so the same
  trace re-landed in another (copied or rotated) file counts as a duplicate instead of training twice.
- ``quarantine``: every invalid line with its file, line, reason and raw text.
- ``ingested_files``: per file path, the bytes consumed (``size``, ``sha256`` of those bytes, ``mtime``)
  and cumulative counts over all passes: ``records = stored + quarantined + duplicates``; summed over
  files, ``stored`` equals the rows of ``traces`` and ``quarantined`` the rows of ``quarantine``.
- ``schema_version``: the trace schema version the tables hold.

Ingest contract (:meth:`TraceWarehouse.ingest_file`): a file whose consumed bytes hash as recorded is
skipped; a file that grew (its recorded bytes are an unchanged prefix) is read from where the last pass
stopped, so only the new lines are ingested; any other change re-reads the whole file (lines already in
the warehouse count as duplicates). An unterminated last line that is not JSON is left for the next
pass (a writer may be mid-line) and reported as ``pending_bytes``. One pass is one transaction, the
``ingested_files`` row included: a failure leaves nothing behind and the rerun redoes the file.

Object storage: a landing root or file given as an ``s3://`` URL is listed (``glob``) and read
(``read_blob``) through DuckDB's httpfs extension, with the same contract; credentials come from an
:class:`S3Settings` (the standard AWS variables) or from a DuckDB secret created beforehand.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Mapping

import duckdb
import pyarrow as pa

from dspark_core.data.limits import INT32_MAX as _INT32_MAX
from dspark_core.data.traces import TRACE_SCHEMA_VERSION, RoundStat, TraceFormatError, TraceRecord

_SAMPLING_SQL = "STRUCT(temperature DOUBLE, top_p DOUBLE, top_k INTEGER, max_new_tokens INTEGER)"
_ROUND_SQL = "STRUCT(drafted INTEGER, verified INTEGER, accepted INTEGER, full_verify BOOLEAN)"
_CALIBRATION_SQL = "STRUCT(source VARCHAR, version INTEGER, temperatures DOUBLE[], shifts DOUBLE[], request_prior DOUBLE)"
#: column name -> (DuckDB type, Arrow type); one entry per TraceRecord field, in field order.
RECORD_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "request_id": ("VARCHAR PRIMARY KEY", pa.string()),
    "timestamp": ("TIMESTAMP NOT NULL", pa.timestamp("us")),
    "domain": ("VARCHAR NOT NULL", pa.string()),
    "prompt_id": ("VARCHAR NOT NULL", pa.string()),
    "prompt_ids": ("INTEGER[] NOT NULL", pa.list_(pa.int32())),
    "completion_ids": ("INTEGER[] NOT NULL", pa.list_(pa.int32())),
    "sampling": (_SAMPLING_SQL + " NOT NULL", pa.struct([("temperature", pa.float64()), ("top_p", pa.float64()),
                                                          ("top_k", pa.int32()), ("max_new_tokens", pa.int32())])),
    "target_fingerprint": ("VARCHAR NOT NULL", pa.string()),
    "drafter": ("VARCHAR", pa.string()),
    "rounds": (_ROUND_SQL + "[] NOT NULL", pa.list_(pa.struct([("drafted", pa.int32()), ("verified", pa.int32()),
                                                                ("accepted", pa.int32()), ("full_verify", pa.bool_())]))),
    "source": ("VARCHAR NOT NULL", pa.string()),
    "finish_reason": ("VARCHAR NOT NULL", pa.string()),
    "schema_version": ("INTEGER NOT NULL", pa.int32()),
    "calibration": (_CALIBRATION_SQL, pa.struct([("source", pa.string()), ("version", pa.int32()),
                                                 ("temperatures", pa.list_(pa.float64())),
                                                 ("shifts", pa.list_(pa.float64())),
                                                 ("request_prior", pa.float64())])),
}
BOOKKEEPING_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "ingested_at": ("TIMESTAMP NOT NULL", pa.timestamp("us")),
    "source_file": ("VARCHAR NOT NULL", pa.string()),
    "source_line": ("INTEGER NOT NULL", pa.int32()),
}
_ALL = {**RECORD_COLUMNS, **BOOKKEEPING_COLUMNS}
_ARROW_SCHEMA = pa.schema([(n, t) for n, (_, t) in _ALL.items()])
_COLS = ", ".join(f'"{n}"' for n in _ALL)
_RECORD_COLS = ", ".join(f'"{n}"' for n in RECORD_COLUMNS)
_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS traces (" + ", ".join(f'"{n}" {sql}' for n, (sql, _) in _ALL.items()) + ")",
    "CREATE TABLE IF NOT EXISTS quarantine (source_file VARCHAR NOT NULL, line INTEGER NOT NULL, "
    "reason VARCHAR NOT NULL, raw VARCHAR NOT NULL, ingested_at TIMESTAMP NOT NULL)",
    "CREATE TABLE IF NOT EXISTS ingested_files (path VARCHAR PRIMARY KEY, size BIGINT NOT NULL, "
    "mtime DOUBLE NOT NULL, sha256 VARCHAR NOT NULL, records INTEGER NOT NULL, stored INTEGER NOT NULL, "
    "quarantined INTEGER NOT NULL, duplicates INTEGER NOT NULL, ingested_at TIMESTAMP NOT NULL)",
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, created_at TIMESTAMP NOT NULL)",
    # columns added to the record since the table was first made: an older warehouse file gains them
    f'ALTER TABLE traces ADD COLUMN IF NOT EXISTS "calibration" {_CALIBRATION_SQL}',
    'ALTER TABLE traces ADD COLUMN IF NOT EXISTS "calibration".request_prior DOUBLE',
]


@dataclass(frozen=True)
class IngestResult:
    """One pass over one file. ``read == stored + quarantined + duplicates`` always holds."""

    read: int
    stored: int
    quarantined: int
    duplicates: int
    skipped_file: bool
    path: str = ""
    pending_bytes: int = 0          # an unterminated, not-yet-JSON last line left for the next pass


@dataclass(frozen=True)
class IngestSummary:
    """All passes of :meth:`TraceWarehouse.ingest_landing`, in file order, with totals."""

    files: list[IngestResult] = field(default_factory=list)

    def _sum(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.files)

    read = property(lambda self: self._sum("read"))
    stored = property(lambda self: self._sum("stored"))
    quarantined = property(lambda self: self._sum("quarantined"))
    duplicates = property(lambda self: self._sum("duplicates"))
    skipped_files = property(lambda self: sum(r.skipped_file for r in self.files))

    def to_dict(self) -> dict:
        return {"files": len(self.files), "skipped_files": self.skipped_files, "read": self.read,
                "stored": self.stored, "quarantined": self.quarantined, "duplicates": self.duplicates}


@dataclass(frozen=True)
class WarehouseTotals:
    """Warehouse-wide counts: sums over ``ingested_files`` (``records = stored + quarantined +
    duplicates``) next to the tables' actual row counts (``trace_rows`` equals ``stored`` and
    ``quarantine_rows`` equals ``quarantined`` when nothing was lost)."""

    records: int
    stored: int
    quarantined: int
    duplicates: int
    trace_rows: int
    quarantine_rows: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LandingIngest:
    """One ingest of a landing folder and the warehouse it left behind: this pass's counts (``files``,
    ``skipped_files``, ``read``, ``stored``, ``quarantined``, ``duplicates``), the warehouse totals after
    it and the domains the warehouse holds."""

    files: int
    skipped_files: int
    read: int
    stored: int
    quarantined: int
    duplicates: int
    totals: WarehouseTotals
    domains: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, summary: IngestSummary, totals: WarehouseTotals, domains: list[str]) -> "LandingIngest":
        return cls(**summary.to_dict(), totals=totals, domains=list(domains))

    @property
    def trace_rows(self) -> int:
        return self.totals.trace_rows

    def to_dict(self) -> dict:
        """Flat: this pass's counts, the totals as ``total_<name>``, ``trace_rows`` and ``domains``."""
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("totals", "domains")}
        return {**counts, **{f"total_{k}": v for k, v in self.totals.to_dict().items()},
                "trace_rows": self.trace_rows, "domains": list(self.domains)}


@dataclass(frozen=True)
class LiveAcceptance:
    """Acceptance over the speculative rounds of one domain's traces: ``records`` traces with ``rounds``
    rounds that ``drafted``, ``verified`` and ``accepted`` so many tokens; ``acceptance`` = accepted /
    verified and ``tau`` = (accepted + rounds) / rounds, i.e. tokens committed per round counting the
    recovered/bonus token. Both are None when there is nothing to divide by."""

    domain: str
    records: int
    rounds: int
    drafted: int
    verified: int
    accepted: int
    acceptance: float | None
    tau: float | None

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------- conversions
def _utc_naive(value: datetime | str) -> datetime:
    """A datetime or ISO string as a naive UTC datetime (a naive input is taken to be UTC)."""
    dt = datetime.fromisoformat(value) if isinstance(value, str) else value
    if not isinstance(dt, datetime):
        raise TypeError(f"expected a datetime or ISO-8601 string, got {type(value).__name__}")
    return dt.astimezone(timezone.utc).replace(tzinfo=None) if dt.tzinfo else dt


def _iso_z(dt: datetime) -> str:
    """Inverse of the stored form: ``...T12:00:00.123Z`` (microseconds only when present)."""
    spec = "milliseconds" if dt.microsecond % 1000 == 0 else "microseconds"
    return dt.isoformat(timespec=spec) + "Z"


def _too_large(rec: TraceRecord) -> str | None:
    """The first field whose integers do not fit the INTEGER columns, or None."""
    checks = [("prompt_ids", rec.prompt_ids), ("completion_ids", rec.completion_ids),
              ("sampling.top_k", [rec.sampling["top_k"]]), ("sampling.max_new_tokens", [rec.sampling["max_new_tokens"]]),
              ("rounds", [v for r in rec.rounds for v in (r.drafted, r.verified, r.accepted)])]
    return next((name for name, values in checks if max(values, default=0) > _INT32_MAX), None)


def _row(rec: TraceRecord, source_file: str, line: int, now: datetime) -> dict:
    d = {f.name: getattr(rec, f.name) for f in fields(TraceRecord)}
    d["timestamp"] = _utc_naive(rec.timestamp)
    d["sampling"] = {k: rec.sampling[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens")}
    d["rounds"] = [{f.name: getattr(r, f.name) for f in fields(RoundStat)} for r in rec.rounds]
    d.update(ingested_at=now, source_file=source_file, source_line=line)
    return d


def _record(row: tuple) -> TraceRecord:
    d = dict(zip(RECORD_COLUMNS, row))
    d["timestamp"] = _iso_z(d["timestamp"])
    d["rounds"] = [RoundStat(**r) for r in d["rounds"]]
    if d.get("calibration") is not None:
        cal = d["calibration"]
        d["calibration"] = {k: cal[k] for k in ("source", "version", "temperatures", "shifts")}
        if cal.get("request_prior") is not None:       # NULL: a record written before the field
            d["calibration"]["request_prior"] = cal["request_prior"]
    return TraceRecord(**d)


def dedup_records(records: Iterable[TraceRecord]) -> list[TraceRecord]:
    """Keep the first record of each ``(prompt_id, completion_ids)``, order preserved."""
    seen, out = set(), []
    for rec in records:
        key = (rec.prompt_id, tuple(rec.completion_ids))
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


# ----------------------------------------------------------------------------------- file parsing
def _parse(line: bytes, where: str) -> TraceRecord:
    """One JSONL line as a record; :class:`TraceFormatError` names ``where`` and the reason."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{where}: not valid UTF-8 (byte {e.start})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    return _validate(d, where)


def _validate(d, where: str) -> TraceRecord:
    """A parsed record, validated by the trace schema and checked to fit the INTEGER columns."""
    rec = TraceRecord.from_dict(d, where)
    too_large = _too_large(rec)
    if too_large:
        raise TraceFormatError(f"{where}: field '{too_large}' holds an integer above {_INT32_MAX}, "
                               f"which the warehouse's INTEGER columns cannot store")
    return rec


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def _parse_lines(data: bytes, start: int, end: int, key: str) -> tuple[list, list]:
    """``(good, bad)``: ``(line, record)`` and ``(line, reason, raw text)`` for non-blank lines in
    ``data[start:end]``, numbered as lines of the whole file."""
    good, bad = [], []
    first = data.count(b"\n", 0, start) + 1
    for i, line in enumerate(data[start:end].split(b"\n")):
        if not line.strip():
            continue
        lineno = first + i
        try:
            good.append((lineno, _parse(line, f"{key}:{lineno}")))
        except TraceFormatError as e:
            bad.append((lineno, str(e), line.decode("utf-8", errors="replace").rstrip("\r")))
    return good, bad


def _vocab_check(good: list, bad: list, vocab_sizes: Mapping[str, int], key: str, data: bytes | None
                 ) -> tuple[list, list]:
    """Move records whose token ids fall outside their target's vocabulary (known by fingerprint) from
    ``good`` to ``bad`` with the reason; records of an unknown target pass unchanged."""
    lines = data.split(b"\n") if data is not None else None
    kept = []
    for lineno, rec in good:
        vocab = vocab_sizes.get(rec.target_fingerprint)
        top = max(max(rec.prompt_ids, default=0), max(rec.completion_ids, default=0))
        if vocab is not None and top >= vocab:
            raw = lines[lineno - 1].decode("utf-8", errors="replace") if lines is not None else json.dumps(
                rec.to_dict())
            bad.append((lineno, f"{key}:{lineno}: token id {top} is outside the vocabulary of target "
                        f"{rec.target_fingerprint[:12]} ({vocab} tokens)", raw))
        else:
            kept.append((lineno, rec))
    return kept, bad


def target_vocab_sizes(targets_dir: Path | str) -> dict[str, int]:
    """``fingerprint -> vocab_size`` of every target prepared under ``targets_dir`` (``<home>/targets``),
    read from each folder's ``dspark_target.json`` and ``config.json``; unreadable folders are skipped."""
    out = {}
    root = Path(targets_dir)
    for manifest in sorted(root.glob("*/dspark_target.json")) if root.is_dir() else ():
        try:
            fp = json.loads(manifest.read_text())["fingerprint"]
            cfg = json.loads((manifest.parent / "config.json").read_text())
            vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
            if isinstance(fp, str) and isinstance(vocab, int) and vocab > 0:
                out[fp] = vocab
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def _parse_parquet(data: bytes, path: str) -> tuple[list, list]:
    """Rows of a Parquet file with the TraceRecord columns, validated like JSONL lines (row = line)."""
    import pyarrow.parquet as pq
    try:
        rows = pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        return [], [(0, f"{path}: not a readable Parquet file ({e})", "")]
    good, bad = [], []
    for i, d in enumerate(rows, 1):
        for name in BOOKKEEPING_COLUMNS:        # a warehouse export (COPY traces TO ...) reads back too
            d.pop(name, None)
        if isinstance(d.get("timestamp"), datetime):
            d["timestamp"] = _iso_z(_utc_naive(d["timestamp"]))
        try:
            good.append((i, _validate(d, f"{path}:{i}")))
        except TraceFormatError as e:
            bad.append((i, str(e), json.dumps(d, default=str)))
    return good, bad


# ----------------------------------------------------------------------------- object storage
def is_object_store(path: Path | str) -> bool:
    """True for an ``s3://`` URL (read through DuckDB's httpfs), False for a local path."""
    return isinstance(path, str) and path.startswith("s3://")


def _sql_literal(value: str | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class S3Settings:
    """Access to ``s3://`` landing paths. Empty fields leave it to DuckDB: a secret created beforehand
    (``CREATE PERSISTENT SECRET ... (TYPE s3, ...)``) or anonymous access to a public bucket."""

    key_id: str = ""
    secret: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    region: str = ""
    endpoint: str = ""              # an S3-compatible store (MinIO, R2, ...): http(s)://host[:port]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "S3Settings":
        """From the standard AWS SDK variables in ``env`` (the caller passes ``os.environ``)."""
        return cls(env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", ""),
                   env.get("AWS_SESSION_TOKEN", ""), env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION", ""),
                   env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", ""))

    def statements(self) -> list[str]:
        """SQL that makes ``s3://`` readable: load httpfs, then a temporary secret when there is a key
        or an endpoint (a custom endpoint uses path-style URLs, SSL as its scheme says)."""
        if not (self.key_id or self.endpoint):
            return ["LOAD httpfs"]
        opts: dict[str, str | bool] = {}
        if self.key_id:
            opts.update(KEY_ID=self.key_id, SECRET=self.secret)
            if self.session_token:
                opts["SESSION_TOKEN"] = self.session_token
        if self.region:
            opts["REGION"] = self.region
        if self.endpoint:
            scheme, sep, host = self.endpoint.partition("://")
            host, scheme = (host, scheme.lower()) if sep else (scheme, "https")
            opts.update(ENDPOINT=host.rstrip("/"), URL_STYLE="path", USE_SSL=scheme == "https")
        body = ", ".join(f"{k} {_sql_literal(v)}" for k, v in opts.items())
        return ["LOAD httpfs", f"CREATE OR REPLACE TEMPORARY SECRET dspark_landing (TYPE s3, PROVIDER config, {body})"]


# ---------------------------------------------------------------------------------- warehouse
class TraceWarehouse:
    """One DuckDB file of traces. Use as a context manager; one writer process at a time (DuckDB
    locks the file), or any number of ``read_only=True`` readers once no writer holds it."""

    batch_rows = 2000               # trace rows per INSERT statement

    def __init__(self, path: Path | str, read_only: bool = False, s3: S3Settings | None = None,
                 vocab_sizes: Mapping[str, int] | None = None):
        self.path = Path(path)
        self.read_only = read_only
        self.vocab_sizes = dict(vocab_sizes or {})      # target fingerprint -> vocabulary size
        self.s3, self._s3_ready = s3 or S3Settings(), False
        if read_only and not self.path.exists():
            raise FileNotFoundError(f"no trace warehouse at {self.path}; ingest traces into it first "
                                    f"(open it without read_only=True)")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except (duckdb.IOException, duckdb.ConnectionException) as e:
            raise RuntimeError(f"cannot open the trace warehouse {self.path} ({e}); DuckDB allows one "
                               f"writing process per file, and no reader while it is open: close the "
                               f"other connection first") from None
        try:
            self._init_schema()
        except BaseException:
            self.con.close()
            raise

    def __enter__(self) -> "TraceWarehouse":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()

    def _q(self, sql: str, params: list | tuple = ()) -> list[tuple]:
        return self.con.execute(sql, list(params)).fetchall()

    def _init_schema(self) -> None:
        if not self.read_only:
            for stmt in _SCHEMA:
                self._q(stmt)
        tables = {r[0] for r in self._q("SELECT table_name FROM information_schema.tables")}
        if "schema_version" not in tables:
            raise RuntimeError(f"{self.path} is not a dspark trace warehouse (no schema_version table)")
        versions = [r[0] for r in self._q("SELECT version FROM schema_version")]
        if not versions and not self.read_only:
            self._q("INSERT INTO schema_version VALUES (?, ?)", [TRACE_SCHEMA_VERSION, _utc_naive(datetime.now(timezone.utc))])
        elif versions and versions != [TRACE_SCHEMA_VERSION]:
            raise RuntimeError(f"{self.path} holds trace schema version {versions}; this dspark reads "
                               f"version {TRACE_SCHEMA_VERSION}: migrate or use a new warehouse file")

    # ---------------------------------------------------------------------------------- ingest
    def ingest_file(self, path: Path | str) -> IngestResult:
        """Ingest one landed ``.jsonl`` (or ``.parquet``) file; see the module docstring for the contract."""
        if self.read_only:
            raise RuntimeError(f"{self.path} is open read-only; open it without read_only=True to ingest")
        if is_object_store(path):
            key = str(path)
            data, mtime = self._read_object(key)
        else:
            path = Path(path).resolve()
            key = str(path)
            data = path.read_bytes()
            mtime = path.stat().st_mtime
        parquet = key.endswith(".parquet")
        prev = self._q("SELECT size, sha256, records, stored, quarantined, duplicates FROM ingested_files "
                       "WHERE path = ?", [key])
        prev = prev[0] if prev else None
        end = len(data) if parquet else self._complete_end(data)   # parquet is immutable: whole file
        digest = hashlib.sha256(data[:end]).hexdigest()
        if prev is not None and prev[1] == digest:                  # unchanged: one hash, nothing to do
            return IngestResult(0, 0, 0, 0, True, key, len(data) - end)
        start = 0 if parquet else self._resume_at(data, prev)     # a grown file resumes where it stopped
        if start > end:                                            # never re-read what was consumed
            end = start
            digest = hashlib.sha256(data[:end]).hexdigest()
        pending = len(data) - end
        if parquet:
            good, bad = _parse_parquet(data, key)
        else:
            good, bad = _parse_lines(data, start, end, key)
        if self.vocab_sizes:
            good, bad = _vocab_check(good, bad, self.vocab_sizes, key, data if not parquet else None)
        now = _utc_naive(datetime.now(timezone.utc))
        self.con.begin()
        try:
            result = self._store(key, good, bad, now, pending)
            totals = [result.read, result.stored, result.quarantined, result.duplicates]
            if prev is not None:
                totals = [a + b for a, b in zip(totals, prev[2:])]
            self._q("INSERT INTO ingested_files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (path) DO UPDATE "
                    "SET size = excluded.size, mtime = excluded.mtime, sha256 = excluded.sha256, "
                    "records = excluded.records, stored = excluded.stored, quarantined = excluded.quarantined, "
                    "duplicates = excluded.duplicates, ingested_at = excluded.ingested_at",
                    [key, end, mtime, digest, *totals, now])
            self.con.commit()
        except BaseException:
            self.con.rollback()
            raise
        return result

    @staticmethod
    def _complete_end(data: bytes) -> int:
        """Where this pass stops: the end, less an unterminated last line that is not (yet) JSON."""
        if not data.endswith(b"\n"):
            tail_at = data.rfind(b"\n") + 1
            if data[tail_at:].strip() and not _is_json(data[tail_at:]):
                return tail_at
        return len(data)

    @staticmethod
    def _resume_at(data: bytes, prev: tuple | None) -> int:
        """Where the last pass stopped when the file only grew since (its prefix is unchanged), else 0."""
        if prev is not None and prev[0] <= len(data) and hashlib.sha256(data[:prev[0]]).hexdigest() == prev[1]:
            return prev[0]
        return 0

    def _store(self, key: str, good: list[tuple[int, TraceRecord]], bad: list[tuple[int, str, str]],
               now: datetime, pending: int) -> IngestResult:
        """Insert one pass's rows (inside the caller's transaction) and count them; the counts are
        checked against the tables' row counts before and after."""
        before = self._row_counts()
        seen = {(line, raw) for line, raw in self._q("SELECT line, raw FROM quarantine WHERE source_file = ?", [key])}
        new_bad = [(key, line, reason, raw, now) for line, reason, raw in bad if (line, raw) not in seen]
        if new_bad:
            self.con.executemany("INSERT INTO quarantine VALUES (?, ?, ?, ?, ?)", new_bad)
        rows, ids = [], set()
        for line, rec in good:
            if rec.request_id not in ids:           # a repeat inside the file is a duplicate
                ids.add(rec.request_id)
                rows.append(_row(rec, key, line, now))
        stored = 0
        for i in range(0, len(rows), self.batch_rows):
            stored += self._insert_batch(rows[i:i + self.batch_rows])
        duplicates = (len(good) - stored) + (len(bad) - len(new_bad))
        result = IngestResult(len(good) + len(bad), stored, len(new_bad), duplicates, False, key, pending)
        added = [x - y for x, y in zip(self._row_counts(), before)]
        if result.read != stored + len(new_bad) + duplicates or added != [stored, len(new_bad)]:
            raise RuntimeError(f"{key}: ingest counts do not add up: {result}, rows added {added}")
        return result

    def _row_counts(self) -> list[int]:
        return list(self._q("SELECT (SELECT count(*) FROM traces), (SELECT count(*) FROM quarantine)")[0])

    def _insert_batch(self, rows: list[dict]) -> int:
        """Insert trace rows, skipping request ids already stored; returns how many were inserted."""
        batch = pa.Table.from_pylist(rows, schema=_ARROW_SCHEMA)
        self.con.register("_dspark_batch", batch)
        try:
            return self._q(f"INSERT INTO traces ({_COLS}) SELECT {_COLS} FROM _dspark_batch ON CONFLICT DO NOTHING")[0][0]
        finally:
            self.con.unregister("_dspark_batch")

    def ingest_landing(self, landing_root: Path | str) -> IngestSummary:
        """Ingest ``<landing_root>/<domain>/*.jsonl`` and ``*.parquet``, sorted by path, one file per
        transaction (a failure keeps the files before it and raises; rerunning resumes there)."""
        if is_object_store(landing_root):
            paths = self._list_objects(str(landing_root).rstrip("/"))
        else:
            root = Path(landing_root)
            paths = sorted(p for p in root.glob("*/*") if p.suffix in (".jsonl", ".parquet") and p.is_file())
        return IngestSummary([self.ingest_file(p) for p in paths])

    def _enable_s3(self) -> None:
        if self._s3_ready:
            return
        load, *secret = self.s3.statements()
        try:
            self._q(load)
        except duckdb.Error as e:
            raise RuntimeError(f"s3:// landing paths need DuckDB's httpfs extension, which could not be loaded "
                               f"({str(e).splitlines()[0]}); install it once where there is network: "
                               f"python -c \"import duckdb; duckdb.sql('INSTALL httpfs')\"") from None
        for stmt in secret:
            self._q(stmt)
        self._s3_ready = True

    def _list_objects(self, root: str) -> list[str]:
        """``<root>/<domain>/*.jsonl`` and ``*.parquet`` objects, sorted (DuckDB glob through httpfs)."""
        self._enable_s3()
        return sorted(f for ext in ("jsonl", "parquet")
                      for (f,) in self._q("SELECT file FROM glob(?)", [f"{root}/*/*.{ext}"]))

    def _read_object(self, url: str) -> tuple[bytes, float]:
        """``(bytes, last-modified epoch seconds)`` of one object (DuckDB read_blob through httpfs)."""
        self._enable_s3()
        rows = self._q("SELECT content, last_modified FROM read_blob(?)", [url])
        if not rows:
            raise FileNotFoundError(f"no object at {url}")
        content, modified = rows[0]
        return bytes(content), modified.timestamp() if modified is not None else 0.0

    # --------------------------------------------------------------------------------- queries
    def count(self, domain: str | None = None) -> int:
        if domain is None:
            return self._q("SELECT count(*) FROM traces")[0][0]
        return self._q("SELECT count(*) FROM traces WHERE domain = ?", [domain])[0][0]

    def domains(self) -> list[str]:
        return [r[0] for r in self._q("SELECT DISTINCT domain FROM traces ORDER BY domain")]

    @staticmethod
    def _where(domain=None, since=None, until=None, target_fingerprint=None, drafter=None) -> tuple[str, list]:
        """SQL filter: ``since <= timestamp < until`` (UTC; naive datetimes are taken as UTC)."""
        conds, params = ["TRUE"], []
        for col, op, value in (("domain", "=", domain), ("timestamp", ">=", since), ("timestamp", "<", until),
                               ("target_fingerprint", "=", target_fingerprint), ("drafter", "=", drafter)):
            if value is not None:
                conds.append(f'"{col}" {op} ?')
                params.append(_utc_naive(value) if col == "timestamp" else value)
        return " AND ".join(conds), params

    def records(self, domain: str | None = None, since: datetime | str | None = None,
                until: datetime | str | None = None, target_fingerprint: str | None = None,
                split_filter: Callable[[str], bool] | None = None, dedup: bool = True) -> list[TraceRecord]:
        """Stored records ordered by (timestamp, request_id), filtered by domain, time window
        ``[since, until)``, target fingerprint and ``split_filter(prompt_id)``; with ``dedup`` the first
        record of each ``(prompt_id, completion_ids)`` is kept."""
        where, params = self._where(domain, since, until, target_fingerprint)
        rows = self._q(f"SELECT {_RECORD_COLS} FROM traces WHERE {where} ORDER BY \"timestamp\", request_id", params)
        pid = list(RECORD_COLUMNS).index("prompt_id")
        recs = [_record(r) for r in rows if split_filter is None or split_filter(r[pid])]
        return dedup_records(recs) if dedup else recs

    def live_acceptance(self, domain: str, since: datetime | str | None = None,
                        drafter: str | None = None) -> LiveAcceptance:
        """Acceptance over the speculative rounds of ``domain``'s traces since ``since`` (optionally of one
        drafter)."""
        where, params = self._where(domain, since, None, None, drafter)
        agg = ", ".join(f"coalesce(sum(list_sum(list_transform(rounds, lambda r: r.{c}))), 0)::BIGINT"
                        for c in ("drafted", "verified", "accepted"))
        n, rounds, drafted, verified, accepted = self._q(
            f"SELECT count(*), coalesce(sum(len(rounds)), 0)::BIGINT, {agg} FROM traces WHERE {where}", params)[0]
        return LiveAcceptance(domain=domain, records=n, rounds=rounds, drafted=drafted, verified=verified,
                              accepted=accepted, acceptance=accepted / verified if verified else None,
                              tau=(accepted + rounds) / rounds if rounds else None)

    def quarantine_rows(self, limit: int = 100) -> list[dict]:
        rows = self._q("SELECT source_file, line, reason, raw, ingested_at FROM quarantine "
                       "ORDER BY source_file, line, ingested_at LIMIT ?", [int(limit)])
        return [dict(zip(("source_file", "line", "reason", "raw", "ingested_at"), r)) for r in rows]

    def ingested_files(self) -> list[dict]:
        cols = ("path", "size", "mtime", "sha256", "records", "stored", "quarantined", "duplicates", "ingested_at")
        return [dict(zip(cols, r)) for r in self._q(f"SELECT {', '.join(cols)} FROM ingested_files ORDER BY path")]

    def totals(self) -> WarehouseTotals:
        """Warehouse-wide counts: sums over ``ingested_files`` next to the actual table row counts."""
        records, stored, quarantined, duplicates = self._q(
            "SELECT coalesce(sum(records), 0), coalesce(sum(stored), 0), coalesce(sum(quarantined), 0), "
            "coalesce(sum(duplicates), 0) FROM ingested_files")[0]
        return WarehouseTotals(records=int(records), stored=int(stored), quarantined=int(quarantined),
                               duplicates=int(duplicates), trace_rows=self.count(),
                               quarantine_rows=self._q("SELECT count(*) FROM quarantine")[0][0])

"""DuckDB trace warehouse and datasets built from it: hermetic, hand-made records, no model."""

import json
from dataclasses import fields
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_core.data.bootstrap import split_file
from dspark_core.data.traces import (TRACE_SCHEMA_VERSION, RoundStat, TraceRecord, landing_dir, prompt_id_of,
                                write_jsonl)
from registry.datasets import build_dataset, dataset_report, examples_from_dataset
from registry.warehouse import BOOKKEEPING_COLUMNS, IngestResult, TraceWarehouse

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 16}


def rec(i: int, domain: str = "code", prompt: str | None = None, day: int = 1, fp: str = "fp-a",
        rounds=(), drafter: str | None = None, completion=None, rid: str | None = None) -> TraceRecord:
    return TraceRecord(
        request_id=rid or f"{domain}-{i}", timestamp=f"2025-01-{day:02d}T12:00:00.{i % 1000:03d}Z",
        domain=domain, prompt_id=prompt_id_of(prompt or f"prompt {i}"), prompt_ids=[1, 2, 3 + i],
        completion_ids=list(completion) if completion is not None else [7, i, 9], sampling=dict(SAMPLING),
        target_fingerprint=fp, drafter=drafter, rounds=list(rounds), source="serving", finish_reason="stop")


def check_counts(wh: TraceWarehouse, *results: IngestResult) -> None:
    for r in results:
        assert r.read == r.stored + r.quarantined + r.duplicates, r
    t = wh.totals()
    assert t.records == t.stored + t.quarantined + t.duplicates, t
    assert t.stored == t.trace_rows and t.quarantined == t.quarantine_rows, t


@pytest.fixture
def wh(tmp_path):
    with TraceWarehouse(tmp_path / "traces.duckdb") as w:
        yield w


# ------------------------------------------------------------------------------------------ schema
def test_traces_table_matches_the_trace_record(wh, tmp_path):
    cols = wh._q("DESCRIBE traces")
    names = [c[0] for c in cols]
    assert names == [f.name for f in fields(TraceRecord)] + list(BOOKKEEPING_COLUMNS)
    types = {c[0]: c[1] for c in cols}
    assert types["prompt_ids"] == types["completion_ids"] == "INTEGER[]"
    assert types["timestamp"] == "TIMESTAMP" and types["rounds"].startswith("STRUCT(")
    assert wh._q("SELECT version FROM schema_version") == [(TRACE_SCHEMA_VERSION,)]
    # every field survives the round trip, None drafter and empty rounds included
    cal = {"source": "live", "version": 3, "temperatures": [1.5, 2.0], "shifts": [-0.2, 0.1]}
    originals = [rec(1, rounds=[RoundStat(4, 4, 2, True), RoundStat(4, 3, 3, False)], drafter="d:v1"),
                 rec(2, completion=[]), TraceRecord(**{**rec(4).to_dict(), "calibration": cal}),
                 TraceRecord(**{**rec(5).to_dict(), "calibration": {**cal, "request_prior": 10.0}}), TraceRecord(**{**rec(3).to_dict(), "timestamp": "2025-01-01T12:00:00.123456Z"})]
    write_jsonl(originals, tmp_path / "a.jsonl")
    wh.ingest_file(tmp_path / "a.jsonl")
    assert wh.records(dedup=False) == originals


def test_reopening_is_idempotent_and_read_only_works_after_the_writer_closes(tmp_path):
    db = tmp_path / "w" / "traces.duckdb"
    with pytest.raises(FileNotFoundError, match="no trace warehouse"):
        TraceWarehouse(db, read_only=True)
    write_jsonl([rec(1), rec(2, domain="math")], tmp_path / "a.jsonl")
    with TraceWarehouse(db) as w:
        w.ingest_file(tmp_path / "a.jsonl")
    with TraceWarehouse(db) as w:                                  # schema creation again: no-op
        assert w.count() == 2 and w._q("SELECT count(*) FROM schema_version") == [(1,)]
    with TraceWarehouse(db, read_only=True) as r:
        assert r.count() == 2 and r.domains() == ["code", "math"] and len(r.records()) == 2
        with pytest.raises(RuntimeError, match="read-only"):
            r.ingest_file(tmp_path / "a.jsonl")
    with TraceWarehouse(db) as w:
        w._q("UPDATE schema_version SET version = ?", [TRACE_SCHEMA_VERSION + 1])
    with pytest.raises(RuntimeError, match="schema version"):
        TraceWarehouse(db)


def test_a_warehouse_made_before_the_calibration_column_gains_it(tmp_path):
    import duckdb
    db = tmp_path / "old.duckdb"
    with TraceWarehouse(db) as w:
        w._q('ALTER TABLE traces DROP COLUMN "calibration"')
    old = [TraceRecord(**{k: v for k, v in rec(1).to_dict().items() if k != "calibration"})]
    con = duckdb.connect(str(db))
    assert "calibration" not in [c[0] for c in con.execute("DESCRIBE traces").fetchall()]
    con.close()
    write_jsonl(old, tmp_path / "a.jsonl")
    with TraceWarehouse(db) as w:
        w.ingest_file(tmp_path / "a.jsonl")
        assert "calibration" in [c[0] for c in w._q("DESCRIBE traces")]
        assert w.records() == old and w.records()[0].calibration is None



def test_a_calibration_column_without_request_prior_gains_the_field(tmp_path):
    db = tmp_path / "old.duckdb"
    with TraceWarehouse(db) as w:                 # the calibration struct as it was made before the field
        w._q('ALTER TABLE traces DROP COLUMN "calibration"')
        w._q('ALTER TABLE traces ADD COLUMN "calibration" '
             'STRUCT(source VARCHAR, version INTEGER, temperatures DOUBLE[], shifts DOUBLE[])')
    cal = {"source": "live", "version": 1, "temperatures": [1.1], "shifts": [0.0]}
    recs = [TraceRecord(**{**rec(1).to_dict(), "calibration": cal}),
            TraceRecord(**{**rec(2).to_dict(), "calibration": {**cal, "request_prior": 10.0}})]
    write_jsonl(recs, tmp_path / "a.jsonl")
    with TraceWarehouse(db) as w:
        w.ingest_file(tmp_path / "a.jsonl")
        assert w.records(dedup=False) == recs

# ------------------------------------------------------------------------------------------ ingest
def test_same_file_twice_adds_nothing(wh, tmp_path):
    land = landing_dir(tmp_path)
    write_jsonl([rec(i) for i in range(5)], land / "code" / "a.jsonl")
    write_jsonl([rec(i, domain="math") for i in range(3)], land / "math" / "b.jsonl")
    first = wh.ingest_landing(land)
    assert first.to_dict() == {"files": 2, "skipped_files": 0, "read": 8, "stored": 8, "quarantined": 0,
                               "duplicates": 0}
    again = wh.ingest_landing(land)
    assert again.skipped_files == 2 and again.read == again.stored == 0
    assert wh.ingest_file(land / "code" / "a.jsonl") == IngestResult(0, 0, 0, 0, True, str((land / "code" / "a.jsonl").resolve()))
    assert wh.count() == 8 and wh.count("math") == 3
    check_counts(wh, *first.files, *again.files)


def test_invalid_lines_are_quarantined_with_file_line_and_reason(wh, tmp_path):
    f = tmp_path / "land" / "code" / "mixed.jsonl"
    write_jsonl([rec(1)], f)
    bad_field = rec(2).to_dict() | {"source": "replay"}
    huge = rec(3).to_dict() | {"prompt_ids": [1, 2**40]}
    with f.open("a") as fh:
        fh.write("{not json\n\n" + json.dumps(bad_field) + "\n" + json.dumps(huge) + "\n")
    write_jsonl([rec(4)], f)
    fh = f.open("ab")
    fh.write(b"\xff\xfe\n")
    fh.close()
    r = wh.ingest_file(f)
    assert (r.read, r.stored, r.quarantined, r.duplicates) == (6, 2, 4, 0)
    assert [x.request_id for x in wh.records()] == ["code-1", "code-4"]
    q = wh.quarantine_rows()
    assert [row["line"] for row in q] == [2, 4, 5, 7]             # line 3 is blank: not a record
    assert all(row["source_file"] == str(f.resolve()) for row in q)
    assert "not valid JSON" in q[0]["reason"] and q[0]["raw"] == "{not json"
    assert "field 'source'" in q[1]["reason"] and json.loads(q[1]["raw"])["source"] == "replay"
    assert "field 'prompt_ids[1]'" in q[2]["reason"] and "INTEGER" in q[2]["reason"]
    assert "UTF-8" in q[3]["reason"]
    assert q[0]["reason"].startswith(f"{f.resolve()}:2:")
    assert wh.ingest_file(f).skipped_file and len(wh.quarantine_rows()) == 4
    check_counts(wh, r)


def test_duplicate_request_ids_are_counted_not_stored(wh, tmp_path):
    write_jsonl([rec(1), rec(2), rec(1, completion=[5])], tmp_path / "a.jsonl")   # request id repeated in-file
    write_jsonl([rec(2), rec(3)], tmp_path / "b.jsonl")                           # and across files
    a, b = wh.ingest_file(tmp_path / "a.jsonl"), wh.ingest_file(tmp_path / "b.jsonl")
    assert (a.read, a.stored, a.duplicates) == (3, 2, 1) and (b.read, b.stored, b.duplicates) == (2, 1, 1)
    assert wh.count() == 3 and wh.records(dedup=False)[0].completion_ids == [7, 1, 9]   # first one kept
    check_counts(wh, a, b)


def test_crash_mid_file_leaves_nothing_and_the_rerun_stores_everything_once(wh, tmp_path, monkeypatch):
    f = tmp_path / "a.jsonl"
    write_jsonl([rec(i) for i in range(7)], f)
    with f.open("a") as fh:
        fh.write("garbage\n")
    wh.batch_rows = 2
    calls = []
    real = TraceWarehouse._insert_batch

    def crash_on_third(self, rows):
        calls.append(len(rows))
        if len(calls) == 3:
            raise OSError("disk gone")
        return real(self, rows)

    monkeypatch.setattr(TraceWarehouse, "_insert_batch", crash_on_third)
    with pytest.raises(OSError, match="disk gone"):
        wh.ingest_file(f)
    assert calls == [2, 2, 2]                                     # two batches were inserted before the crash
    assert wh.count() == 0 and wh.ingested_files() == [] and wh.quarantine_rows() == []
    monkeypatch.setattr(TraceWarehouse, "_insert_batch", real)
    r = wh.ingest_file(f)
    assert (r.read, r.stored, r.quarantined, r.duplicates, r.skipped_file) == (8, 7, 1, 0, False)
    assert wh.count() == 7 and wh.ingest_file(f).skipped_file
    check_counts(wh, r)


def test_a_grown_file_ingests_only_the_new_lines(wh, tmp_path):
    f = tmp_path / "land" / "code" / "serving-0.jsonl"
    write_jsonl([rec(1), rec(2)], f)
    with f.open("a") as fh:
        fh.write("oops\n")
    r1 = wh.ingest_file(f)
    write_jsonl([rec(3), rec(1, rid="code-1")], f)                # one new, one re-landed request
    with f.open("a") as fh:
        fh.write(rec(4).to_json()[:30])                           # a writer mid-line: left for later
    r2 = wh.ingest_file(f)
    assert (r2.read, r2.stored, r2.quarantined, r2.duplicates) == (2, 1, 0, 1) and r2.pending_bytes == 30
    assert wh.ingest_file(f).skipped_file                         # the torn tail alone changes nothing
    with f.open("a") as fh:
        fh.write(rec(4).to_json()[30:] + "\n")
    r3 = wh.ingest_file(f)
    assert (r3.read, r3.stored, r3.pending_bytes) == (1, 1, 0)
    lines = dict(wh._q("SELECT request_id, source_line FROM traces"))
    assert lines == {"code-1": 1, "code-2": 2, "code-3": 4, "code-4": 6}
    row, = wh.ingested_files()
    assert (row["records"], row["stored"], row["quarantined"], row["duplicates"]) == (6, 4, 1, 1)
    assert row["size"] == f.stat().st_size and len(wh.quarantine_rows()) == 1
    check_counts(wh, r1, r2, r3)
    # a rewritten file (recorded bytes no longer a prefix) is read again: known lines are duplicates,
    # the same bad text at the same line included
    write_jsonl([rec(2), rec(5)], f, append=False)
    with f.open("a") as fh:
        fh.write("oops\nnew junk\n")
    r4 = wh.ingest_file(f)
    assert (r4.read, r4.stored, r4.quarantined, r4.duplicates) == (4, 1, 1, 2)
    check_counts(wh, r4)


def test_parquet_files_with_the_record_columns_are_ingested(wh, tmp_path):
    land = landing_dir(tmp_path)
    rows = [rec(1, rounds=[RoundStat(3, 3, 1, True)]).to_dict(), rec(2).to_dict() | {"domain": "BAD"}]
    (land / "code").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), land / "code" / "x.parquet")
    s = wh.ingest_landing(land)
    assert (s.read, s.stored, s.quarantined) == (2, 1, 1) and wh.records() == [rec(1, rounds=[RoundStat(3, 3, 1, True)])]
    assert "field 'domain'" in wh.quarantine_rows()[0]["reason"] and wh.ingest_landing(land).skipped_files == 1
    check_counts(wh, *s.files)


# ----------------------------------------------------------------------------------------- queries
def test_domain_window_fingerprint_split_and_dedup_queries(wh, tmp_path):
    recs = [rec(1, day=1), rec(2, day=2, fp="fp-b"), rec(3, day=3), rec(4, domain="math", day=2),
            rec(5, day=4, prompt="prompt 3", completion=[7, 3, 9])]  # same prompt and completion as rec 3
    write_jsonl(recs, tmp_path / "a.jsonl")
    wh.ingest_file(tmp_path / "a.jsonl")
    ids = lambda rs: [r.request_id for r in rs]                    # noqa: E731
    assert wh.domains() == ["code", "math"] and wh.count("code") == 4 and wh.count() == 5
    assert ids(wh.records("code")) == ["code-1", "code-2", "code-3"]
    assert ids(wh.records("code", dedup=False)) == ["code-1", "code-2", "code-3", "code-5"]
    assert ids(wh.records(since="2025-01-02T00:00:00Z", until=datetime(2025, 1, 3))) == ["code-2", "math-4"]
    assert ids(wh.records(since=datetime(2025, 1, 2, 13, tzinfo=timezone.utc))) == ["code-3"]
    assert ids(wh.records(target_fingerprint="fp-b")) == ["code-2"]
    keep = {prompt_id_of("prompt 1"), prompt_id_of("prompt 4")}
    assert ids(wh.records(split_filter=lambda pid: pid in keep)) == ["code-1", "math-4"]


def test_live_acceptance_arithmetic(wh, tmp_path):
    write_jsonl([rec(1, day=1, drafter="d:v1", rounds=[RoundStat(4, 4, 4, True)]),
                 rec(2, day=2, drafter="d:v1", rounds=[RoundStat(4, 4, 2, True), RoundStat(4, 2, 1, False)]),
                 rec(3, day=3, drafter="d:v2", rounds=[RoundStat(8, 5, 0, False)]),
                 rec(4, day=3),                                   # plain decoding: no rounds
                 rec(5, day=3, domain="math", drafter="d:v1", rounds=[RoundStat(4, 4, 4, True)])],
                tmp_path / "a.jsonl")
    wh.ingest_file(tmp_path / "a.jsonl")
    la = wh.live_acceptance("code")
    assert (la.records, la.rounds, la.drafted, la.verified, la.accepted) == (4, 4, 20, 15, 7)
    assert la.acceptance == pytest.approx(7 / 15) and la.tau == pytest.approx((7 + 4) / 4)
    la = wh.live_acceptance("code", since="2025-01-02T00:00:00Z", drafter="d:v1")
    assert (la.rounds, la.accepted, la.verified, la.tau) == (2, 3, 6, pytest.approx(2.5))
    empty = wh.live_acceptance("chat")
    assert empty.rounds == 0 and empty.tau is None and empty.acceptance is None
    assert set(empty.to_dict()) == {"domain", "records", "rounds", "drafted", "verified", "accepted", "acceptance",
                                    "tau"}


# ---------------------------------------------------------------------------------------- datasets
def test_build_dataset_keeps_held_out_and_unsplit_prompts_out_of_train(wh, tmp_path):
    home = tmp_path / "home"
    p = {name: prompt_id_of(name) for name in ("t1", "t2", "h1", "new")}
    sf = split_file(home, "code")
    sf.parent.mkdir(parents=True)
    sf.write_text(json.dumps({"seed": 0, "heldout_fraction": 0.5,
                              "assignments": {p["t1"]: "train", p["t2"]: "train", p["h1"]: "heldout"}}))
    write_jsonl([rec(1, prompt="t1"), rec(2, prompt="h1"), rec(3, prompt="t2", fp="fp-b"),
                 rec(4, prompt="new"), rec(5, prompt="t1", completion=[7, 1, 9]),    # duplicate of rec 1
                 rec(6, prompt="t1", day=5)], tmp_path / "a.jsonl")
    wh.ingest_file(tmp_path / "a.jsonl")
    train = build_dataset(wh, "code", "train", home)
    assert train["request_id"] == ["code-1", "code-3", "code-6"]
    assert set(train["prompt_id"]) == {p["t1"], p["t2"]}
    assert train[0]["input_ids"] == [1, 2, 4, 7, 1, 9] and train[0]["response_start"] == 3
    report = dataset_report(train)
    assert (report["records"], report["in_split"], report["other_split"], report["unsplit_excluded"],
            report["duplicates_dropped"], report["rows"]) == (6, 4, 1, 1, 1, 3)
    held = build_dataset(wh, "code", "heldout", home)
    assert held["request_id"] == ["code-2"] and dataset_report(held)["unsplit_excluded"] == 1
    assert build_dataset(wh, "code", "train", home, target_fingerprint="fp-b")["request_id"] == ["code-3"]
    assert build_dataset(wh, "code", "train", home, until="2025-01-02T00:00:00Z")["request_id"] == ["code-1", "code-3"]
    assert len(build_dataset(wh, "code", "train", home, since="2030-01-01T00:00:00Z")) == 0
    ex = examples_from_dataset(train)
    assert [(e.token_ids, e.response_start, e.domain) for e in ex][0] == ([1, 2, 4, 7, 1, 9], 3, "code")
    with pytest.raises(FileNotFoundError, match="dspark traces bootstrap"):
        build_dataset(wh, "math", "train", home)
    with pytest.raises(ValueError, match="split must be"):
        build_dataset(wh, "code", "test", home)


def test_foreign_token_ids_and_non_finite_sampling_are_quarantined(tmp_path):
    from registry.warehouse import target_vocab_sizes
    targets = tmp_path / "targets" / "tiny"
    targets.mkdir(parents=True)
    (targets / "dspark_target.json").write_text(json.dumps({"fingerprint": "fp-a"}))
    (targets / "config.json").write_text(json.dumps({"vocab_size": 100}))
    (tmp_path / "targets" / "broken").mkdir()
    (tmp_path / "targets" / "broken" / "dspark_target.json").write_text("{")
    assert target_vocab_sizes(tmp_path / "targets") == {"fp-a": 100}
    f = tmp_path / "land" / "code" / "x.jsonl"
    write_jsonl([rec(1), rec(2, fp="fp-other", completion=[500])], f)     # an unknown target passes as is
    lines = [rec(3, completion=[7, 100]).to_dict(),                          # id 100 >= vocab 100
             rec(4).to_dict() | {"sampling": SAMPLING | {"temperature": float("nan")}},
             rec(5).to_dict() | {"sampling": SAMPLING | {"top_p": float("inf")}},
             rec(6).to_dict() | {"sampling": SAMPLING | {"top_k": 10**12}}]
    with f.open("a") as fh:
        fh.write("".join(json.dumps(d) + "\n" for d in lines))
    with TraceWarehouse(tmp_path / "w.duckdb", vocab_sizes=target_vocab_sizes(tmp_path / "targets")) as wh:
        r = wh.ingest_file(f)
        assert (r.read, r.stored, r.quarantined) == (6, 2, 4)
        reasons = {row["line"]: row["reason"] for row in wh.quarantine_rows()}
        assert "outside the vocabulary" in reasons[3] and "(100 tokens)" in reasons[3]
        assert "temperature" in reasons[4] and "finite" in reasons[4]
        assert "top_p" in reasons[5] and "top_k" in reasons[6] and "INTEGER" in reasons[6]
        check_counts(wh, r)

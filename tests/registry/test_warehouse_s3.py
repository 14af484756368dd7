"""s3:// landing through DuckDB's httpfs, checked without network: URL detection, the statements that set
up httpfs and the credentials, the clear error when httpfs is missing, and the DuckDB listing and
reading route (glob + read_blob) run on local files, which must ingest exactly like the local route."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import registry.warehouse as warehouse
from dspark_core.data.traces import landing_dir, write_jsonl
from registry.cli import RegistrySettings
from registry.warehouse import S3Settings, TraceWarehouse, is_object_store
from test_warehouse import check_counts, rec

REPO = Path(__file__).resolve().parents[2]


def test_only_s3_url_strings_are_object_store_paths():
    assert is_object_store("s3://bucket/landing")
    assert not is_object_store("/data/landing") and not is_object_store("landing/s3://x")
    assert not is_object_store(Path("s3://bucket/landing"))       # a Path is local (and already mangled)


def test_settings_keep_an_s3_landing_url_and_a_local_landing_path(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    monkeypatch.setenv("DSPARK_LANDING", "s3://traces-bucket/prod/landing")
    assert RegistrySettings.from_env().landing == "s3://traces-bucket/prod/landing"
    monkeypatch.setenv("DSPARK_LANDING", str(tmp_path / "land"))
    assert RegistrySettings.from_env().landing == tmp_path / "land"
    monkeypatch.delenv("DSPARK_LANDING")
    assert RegistrySettings.from_env().landing == tmp_path.resolve() / "landing"


def test_s3_settings_from_the_standard_aws_variables():
    s = S3Settings.from_env({"AWS_ACCESS_KEY_ID": "AKIAX", "AWS_SECRET_ACCESS_KEY": "sec", "AWS_SESSION_TOKEN": "tok",
                             "AWS_DEFAULT_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "https://generic:1"})
    assert (s.key_id, s.secret, s.session_token, s.region, s.endpoint) == ("AKIAX", "sec", "tok", "eu-west-1",
                                                                          "https://generic:1")
    assert "sec" not in repr(s) and "tok" not in repr(s)
    s = S3Settings.from_env({"AWS_REGION": "us-east-2", "AWS_DEFAULT_REGION": "eu-west-1",
                             "AWS_ENDPOINT_URL": "https://generic:1", "AWS_ENDPOINT_URL_S3": "http://minio:9000"})
    assert (s.region, s.endpoint) == ("us-east-2", "http://minio:9000")
    assert S3Settings.from_env({}) == S3Settings()


def test_statements_load_httpfs_and_make_a_secret_only_when_given_one():
    assert S3Settings().statements() == ["LOAD httpfs"]
    assert S3Settings(region="eu-west-1").statements() == ["LOAD httpfs"]     # region alone: DuckDB's own secret
    load, secret = S3Settings("AKIAX", "se'cret", "tok", "eu-west-1").statements()
    assert load == "LOAD httpfs"
    assert secret == ("CREATE OR REPLACE TEMPORARY SECRET dspark_landing (TYPE s3, PROVIDER config, "
                      "KEY_ID 'AKIAX', SECRET 'se''cret', SESSION_TOKEN 'tok', REGION 'eu-west-1')")
    _, minio = S3Settings("minio", "minio123", endpoint="http://minio:9000/").statements()
    assert minio.endswith("KEY_ID 'minio', SECRET 'minio123', ENDPOINT 'minio:9000', URL_STYLE 'path', USE_SSL false)")
    _, anonymous = S3Settings(endpoint="objects.example.com").statements()
    assert anonymous.endswith("(TYPE s3, PROVIDER config, ENDPOINT 'objects.example.com', URL_STYLE 'path', "
                              "USE_SSL true)")


def _no_httpfs(wh: TraceWarehouse, ext_dir: Path) -> None:
    """Make sure httpfs cannot load even where it is installed: empty extension folder, no auto-install."""
    for stmt in ("SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
                 f"SET extension_directory = '{ext_dir}'"):
        wh._q(stmt)


def test_missing_httpfs_is_one_clear_error_and_nothing_is_ingested(tmp_path):
    with TraceWarehouse(tmp_path / "traces.duckdb", s3=S3Settings("AKIAX", "sec")) as wh:
        _no_httpfs(wh, tmp_path / "ext")
        for call in (lambda: wh.ingest_landing("s3://bucket/landing"), lambda: wh.ingest_file("s3://b/code/a.jsonl")):
            with pytest.raises(RuntimeError, match=r"s3:// landing paths need DuckDB's httpfs extension.*"
                                                   r"INSTALL httpfs") as e:
                call()
            assert "\n" not in str(e.value)
        assert wh.count() == 0 and wh.ingested_files() == []


def test_cli_ingest_from_s3_reports_the_missing_extension(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "DSPARK_HOME": str(tmp_path / "home"),
           "DSPARK_LANDING": "s3://bucket/landing"}                # HOME: DuckDB's extension folder is empty
    res = subprocess.run([sys.executable, "-m", "dspark_core.cli", "warehouse", "ingest"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "s3:// landing paths need DuckDB's httpfs extension" in res.stderr, res.stderr[-2000:]


def test_the_object_store_route_ingests_like_the_local_route(tmp_path, monkeypatch):
    """glob + read_blob are the statements httpfs serves for s3://; DuckDB runs them on local files too, so
    the route is exercised here with the landing folder standing in for the bucket."""
    land = landing_dir(tmp_path)
    write_jsonl([rec(i) for i in range(4)], land / "code" / "b.jsonl")
    write_jsonl([rec(i, domain="math") for i in range(3)] + [rec(0)], land / "math" / "a.jsonl")
    (land / "code" / "notes.txt").write_text("not a trace file")
    (land / "code" / "broken.jsonl").write_text('{"request_id": 1}\n')

    with TraceWarehouse(tmp_path / "local.duckdb") as local:
        expected = local.ingest_landing(land).to_dict()
        expected_records = local.records(dedup=False)

    enabled = []
    monkeypatch.setattr(warehouse, "is_object_store", lambda p: isinstance(p, str) and p.startswith(str(tmp_path)))
    monkeypatch.setattr(TraceWarehouse, "_enable_s3", lambda self: enabled.append(True))
    root = str(land) + "/"
    with TraceWarehouse(tmp_path / "remote.duckdb") as wh:
        first = wh.ingest_landing(root)
        assert enabled
        assert [r.path for r in first.files] == [f"{land}/code/b.jsonl", f"{land}/code/broken.jsonl",
                                                 f"{land}/math/a.jsonl"]
        assert first.to_dict() == expected
        assert wh.records(dedup=False) == expected_records
        again = wh.ingest_landing(root)
        assert again.skipped_files == 3 and again.read == 0
        write_jsonl([rec(i, domain="math") for i in range(3, 5)], land / "math" / "a.jsonl")     # appends
        grown = wh.ingest_landing(root)
        assert (grown.read, grown.stored, grown.skipped_files) == (2, 2, 2)
        assert all(f["mtime"] > 0 for f in wh.ingested_files())
        check_counts(wh, *first.files, *again.files, *grown.files)



def test_the_secret_statement_is_valid_duckdb_sql(tmp_path):
    """Without httpfs DuckDB still parses the statement and only then misses the s3 provider: a syntax
    error would surface as a ParserException instead."""
    import duckdb
    _, secret = S3Settings("AKIAX", "se'c", "tok", "eu-west-1", "http://minio:9000").statements()
    con = duckdb.connect()
    for stmt in ("SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
                 f"SET extension_directory = '{tmp_path}'"):
        con.execute(stmt)
    with pytest.raises(duckdb.Error, match="httpfs") as e:
        con.execute(secret)
    assert not isinstance(e.value, duckdb.ParserException)

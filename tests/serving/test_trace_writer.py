"""The trace writer: never blocks, counts drops when its buffer is full or a write fails, rotates files,
and writes records the warehouse ingests. It takes only TraceRecord objects, validated where they are
built, so a malformed record fails in its maker's thread and never reaches the queue."""

import time

import pytest

from dspark_core.data.traces import RoundStat, TraceFormatError, TraceRecord, read_jsonl
from serving.trace_writer import TraceWriter


def _fields(i: int, domain: str = "code") -> dict:
    return {"request_id": f"cmpl-{i}", "timestamp": "2026-11-29T12:00:00.000Z", "domain": domain,
            "prompt_id": f"{i:016x}", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5],
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 2},
            "target_fingerprint": "fp", "drafter": "dspark-code:v1",
            "rounds": [RoundStat(4, 2, 1, False), RoundStat(4, 4, 0, True)],
            "source": "serving", "finish_reason": "length"}


def _rec(i: int, domain: str = "code") -> TraceRecord:
    return TraceRecord(**_fields(i, domain))


def test_full_buffer_drops_without_blocking_then_drains(tmp_path):
    dropped = []
    w = TraceWriter(tmp_path / "landing", buffer=3, on_dropped=dropped.append)
    t0 = time.perf_counter()
    accepted = [w.submit(_rec(i)) for i in range(5)]          # writer thread not started: the queue fills
    assert time.perf_counter() - t0 < 0.5
    assert accepted == [True, True, True, False, False] and w.dropped == 2 and dropped == [1, 1]
    w.start()
    assert w.flush()
    assert w.written == 3
    w.close()
    (f,) = w.files()
    recs = [r for _, r in read_jsonl(f)]
    assert [r.request_id for r in recs] == ["cmpl-0", "cmpl-1", "cmpl-2"]
    assert recs[0].rounds[1].full_verify is True


def test_rotation_by_size(tmp_path):
    w = TraceWriter(tmp_path / "landing", buffer=100, rotate_bytes=600).start()
    for i in range(6):
        w.submit(_rec(i, "code" if i % 2 else "chat"))
    assert w.flush()
    w.close()
    assert w.written == 6 and w.dropped == 0
    files = w.files()
    assert len(files) > 2 and {f.parent.name for f in files} == {"code", "chat"}
    ids = sorted(r.request_id for f in files for _, r in read_jsonl(f))
    assert ids == [f"cmpl-{i}" for i in range(6)]


def test_an_invalid_record_fails_where_it_is_built_and_never_counts_as_dropped(tmp_path):
    with pytest.raises(TraceFormatError, match="verified"):
        RoundStat(drafted=1, verified=2, accepted=0, full_verify=False)      # verified > drafted
    with pytest.raises(TraceFormatError, match="target_fingerprint"):
        TraceRecord(**{**_fields(1), "target_fingerprint": ""})
    w = TraceWriter(tmp_path / "landing", buffer=4)
    with pytest.raises(TypeError, match="TraceRecord"):
        w.submit(_fields(2))                                                  # a plain dict is a caller bug
    w.start()
    assert w.flush() and (w.written, w.dropped) == (0, 0)
    w.close()


def test_a_failed_write_drops_the_record_and_counts_it(tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "code").write_text("a file where the domain's folder should be")
    dropped = []
    w = TraceWriter(landing, buffer=4, on_dropped=dropped.append).start()
    assert w.submit(_rec(1, "code")) and w.submit(_rec(2, "chat"))
    assert w.flush()
    w.close()
    assert (w.written, w.dropped, dropped) == (1, 1, [1])
    (f,) = w.files()
    assert [r.request_id for _, r in read_jsonl(f)] == ["cmpl-2"]

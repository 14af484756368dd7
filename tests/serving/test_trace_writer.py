"""The trace writer: never blocks, counts drops when its buffer is full, rotates files, and writes records
the warehouse ingests."""

import time

from dspark_core.data.traces import read_jsonl
from serving.trace_writer import TraceWriter


def _rec(i: int, domain: str = "code") -> dict:
    return {"request_id": f"cmpl-{i}", "timestamp": "2026-11-29T12:00:00.000Z", "domain": domain,
            "prompt_id": f"{i:016x}", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5],
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 2},
            "target_fingerprint": "fp", "drafter": "dspark-code:v1",
            "rounds": [{"drafted": 4, "verified": 2, "accepted": 1, "full_verify": False},
                       {"drafted": 4, "verified": 4, "accepted": 0, "full_verify": True}],
            "source": "serving", "finish_reason": "length"}


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


def test_rotation_by_size_and_invalid_records_are_counted(tmp_path):
    w = TraceWriter(tmp_path / "landing", buffer=100, rotate_bytes=600).start()
    for i in range(6):
        w.submit(_rec(i, "code" if i % 2 else "chat"))
    bad = _rec(99)
    bad["rounds"] = [{"drafted": 1, "verified": 2, "accepted": 0, "full_verify": False}]   # verified > drafted
    w.submit(bad)
    assert w.flush()
    w.close()
    assert w.written == 6 and w.dropped == 1
    files = w.files()
    assert len(files) > 2 and {f.parent.name for f in files} == {"code", "chat"}
    ids = sorted(r.request_id for f in files for _, r in read_jsonl(f))
    assert ids == [f"cmpl-{i}" for i in range(6)]

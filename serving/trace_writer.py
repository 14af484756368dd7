"""Background trace writer: finished requests become :class:`~dspark_core.data.traces.TraceRecord` lines in
rotated JSONL files under the landing folder, ``<landing>/<domain>/serving-<server>-<seq>.jsonl``.

The engine only calls :meth:`TraceWriter.submit` with a :class:`TraceRecord`, validated where it was
built: a non-blocking put into a bounded queue. When the queue is full (the disk fell behind) the record
is dropped and counted; decoding never waits for the disk. A daemon thread appends the records one line
+ flush at a time (a crash tears at most the last line, which the warehouse ingest leaves for the next
pass) and rotates a domain's file by size or age; a write that fails (disk full, permissions) drops
that record, counted the same way. The warehouse ingests ``*/*.jsonl`` and reads a growing file from where
its last pass stopped, so rotation only bounds file size; it is not needed for correctness.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from dspark_core.data.traces import TraceRecord

log = logging.getLogger("dspark.serving.traces")
_STOP = object()


class TraceWriter:
    def __init__(self, landing: Path, buffer: int = 4096, rotate_bytes: int = 64 << 20,
                 rotate_seconds: float = 3600.0, on_written: Callable[[int], None] | None = None,
                 on_dropped: Callable[[int], None] | None = None, server_id: str | None = None):
        self.landing = Path(landing)
        self.rotate_bytes, self.rotate_seconds = rotate_bytes, rotate_seconds
        self.server_id = server_id or uuid.uuid4().hex[:8]
        self._q: queue.Queue = queue.Queue(maxsize=buffer)
        self._on_written = on_written or (lambda n: None)
        self._on_dropped = on_dropped or (lambda n: None)
        self._files: dict[str, tuple[object, Path, float]] = {}     # domain -> (handle, path, opened at)
        self._seq = 0
        self.written = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="dspark-trace-writer", daemon=True)
        self._started = False

    def start(self) -> "TraceWriter":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def submit(self, record: TraceRecord) -> bool:
        """Queue one record; never blocks. False = dropped (buffer full). Anything but a TraceRecord is a
        TypeError here, in the caller's thread."""
        if not isinstance(record, TraceRecord):
            raise TypeError(f"the trace writer takes TraceRecord objects, got {type(record).__name__}")
        try:
            self._q.put_nowait(record)
            return True
        except queue.Full:
            self.dropped += 1
            self._on_dropped(1)
            return False

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record queued so far is on disk (tests, shutdown)."""
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._started:
            try:
                self._q.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        for handle, _, _ in self._files.values():
            handle.close()
        self._files.clear()

    def files(self) -> list[Path]:
        return sorted(self.landing.glob(f"*/serving-{self.server_id}-*.jsonl"))

    # ---- writer thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
                self.written += 1
                self._on_written(1)
            except OSError as e:
                self.dropped += 1
                self._on_dropped(1)
                log.warning("trace record dropped: %s", e)

    def _write(self, record: TraceRecord) -> None:
        handle = self._handle(record.domain)
        handle.write(record.to_json() + "\n")
        handle.flush()

    def _handle(self, domain: str):
        now = time.monotonic()
        cur = self._files.get(domain)
        if cur is not None:
            handle, path, opened = cur
            if handle.tell() < self.rotate_bytes and now - opened < self.rotate_seconds:
                return handle
            handle.close()
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S")
        path = self.landing / domain / f"serving-{self.server_id}-{stamp}-{self._seq:05d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a", encoding="utf-8")
        self._files[domain] = (handle, path, now)
        return handle

"""The admin audit log: every admin action, poll-triggered swap and canary verdict, as JSONL on disk and
the most recent entries in memory (``GET /admin/audit``)."""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from pathlib import Path

from dspark_core.data.traces import utc_now_iso

log = logging.getLogger("dspark.serving.audit")


class AuditLog:
    def __init__(self, path: Path | None, keep: int = 1000):
        self.path = Path(path) if path is not None else None
        self._recent: deque[dict] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, action: str, domain: str | None, actor: str, outcome: str, **detail) -> dict:
        """Append one entry (``ts``, ``action``, ``domain``, ``actor``, ``outcome`` plus details)."""
        entry = {"ts": utc_now_iso(), "action": action, "domain": domain, "actor": actor, "outcome": outcome,
                 **detail}
        with self._lock:
            self._recent.append(entry)
            if self.path is not None:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    with self.path.open("a", encoding="utf-8") as f:
                        f.write(json.dumps(entry, default=str) + "\n")
                except OSError as e:        # the audit file must not take the server down
                    log.error("audit log write failed (%s): %s", self.path, e)
        log.info("audit: %s", entry)
        return entry

    def recent(self, limit: int = 100) -> list[dict]:
        with self._lock:
            return list(self._recent)[-limit:]

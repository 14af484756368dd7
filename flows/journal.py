"""The step journal: one JSON line per pipeline step that actually ran (``start`` and ``done``).

Cached (resumed) steps do not run, so they leave no line: the journal shows what a run really did,
and an operator (or a test) can check that a resumed run did not redo finished work. File:
``$DSPARK_HOME/flows/journal.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def record(workdir: Path, step: str, key: str, event: str, **extra) -> None:
    path = Path(workdir) / "journal.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
                       "step": step, "key": key, "event": event, **extra}, default=str)
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()


def read(workdir: Path) -> list[dict]:
    path = Path(workdir) / "journal.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:          # a line torn by a kill
            continue
    return out

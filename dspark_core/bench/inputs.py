"""What a suite is given besides its config: a way to load the target, and the drafters the drafters
bench trained (the load, batch and demo runs measure those)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from dspark_core.model.target import Target

Log = Callable[[str], None]


class TargetLoader(Protocol):
    """Loads the target the user chose (``--target``/``--model``, ``--device``). Suites that measure
    several dtypes, or compare with the HF reference model, load through it; ``dtype`` None keeps the
    chosen one."""

    def __call__(self, dtype: str | None = None, keep_reference: bool = False) -> Target: ...


def trained_checkpoint(home: Path, name: str = "dspark-generic") -> Path | None:
    """The newest checkpoint folder ``name`` (``dspark-generic``, ``dspark-code``, ...) that
    ``dspark bench --suite drafters`` trained under ``home``, or None."""
    found = sorted((home / "bench").glob(f"drafters-*/{name}/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def bench_checkpoint(home: Path, checkpoint: str | Path | None) -> Path:
    """``checkpoint`` when given, else the newest generic DSpark checkpoint the drafters bench trained."""
    if checkpoint:
        return Path(checkpoint)
    found = trained_checkpoint(home)
    if found is None:
        raise ValueError("no DSpark checkpoint: pass --checkpoint or run dspark bench --suite drafters first")
    return found

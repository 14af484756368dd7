"""A suite's result on disk: where it goes, and the ``meta`` block that says how it was made.

Every result carries ``meta``: the command, the commit of the code that ran (and whether that code had
local changes), the UTC date, the host (CPU model and ISA flags, cores, torch threads and version,
device and dtype; the GPU and CUDA version on CUDA) and the wall time. Inside a git checkout a full run
writes ``benchmarks/results/<suite>.json``, the committed figures that ``dspark bench report`` renders
into docs/results.md; quick runs, and runs of an installed package, write ``$DSPARK_HOME/bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

from dspark_core.scheduling.sps import host_fingerprint

# what the committed file leaves out (``--json`` still prints everything): per-repetition rows and the
# SPS(B) profiles the load suite measured along the way; its medians, paired ratios, ECE and gate state stay
DROPPED_FROM_FILE = {"load": ("runs", "sps", "step_cost")}
# the code whose changes make a result "dirty": result files, docs and the README are written by the bench
CODE_PATHS = ("dspark_core", "serving", "registry", "flows", "pyproject.toml")


def repo_root() -> Path | None:
    """The git checkout this package runs from (an editable install), or None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / ".git").exists() and (root / "pyproject.toml").exists() else None


def results_dir(home: Path, quick: bool, out: str | Path | None = None) -> Path:
    """``out`` when given; else the committed ``benchmarks/results`` of this checkout for a full run, or
    ``$DSPARK_HOME/bench`` for a quick run (it must never replace committed figures) or outside a checkout."""
    if out:
        return Path(out)
    root = repo_root()
    return root / "benchmarks" / "results" if root is not None and not quick else home / "bench"


def git_state(root: Path | None = None) -> dict:
    """The commit of the code that ran and whether that code differs from it (result files aside)."""
    root = root or repo_root()
    if root is None:
        return {"commit": None, "dirty": None}

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(root), *argv], check=True, capture_output=True, text=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).strip())
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def host(device: str, dtypes: tuple[str, ...]) -> dict:
    """The machine a suite ran on: :func:`~dspark_core.scheduling.sps.host_fingerprint` plus the cores
    this process may use and, on CUDA, the CUDA version. ``dtypes``: what the suite ran in."""
    dev = torch.device(device)
    info = {**host_fingerprint(dev), "dtype": " + ".join(dtypes)}
    info["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if dev.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def run_meta(command: str, device: str, dtypes: tuple[str, ...], wall_seconds: float, quick: bool) -> dict:
    return {"command": command, **git_state(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": host(device, dtypes), "wall_seconds": round(wall_seconds, 1), "quick": quick}


def with_meta(result: dict, meta: dict) -> dict:
    """``result`` with ``meta`` right after its ``suite`` key (what a reader looks at first)."""
    return {"suite": result.get("suite"), "meta": meta, **{k: v for k, v in result.items() if k != "suite"}}


def for_file(result: dict) -> dict:
    """What the result file keeps: :data:`DROPPED_FROM_FILE` left out, and said so in ``meta``."""
    drop = [k for k in DROPPED_FROM_FILE.get(result.get("suite"), ()) if k in result]
    if not drop:
        return result
    kept = {k: v for k, v in result.items() if k not in drop}
    kept["meta"] = {**kept.get("meta", {}), "dropped": drop}
    return kept


def to_json(obj, indent: int = 0) -> str:
    """JSON with one key per line but each list of plain values on one line: small files, short diffs."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and obj and any(isinstance(x, (dict, list, tuple)) for x in obj):
        return "[\n" + ",\n".join(f"{inner}{to_json(x, indent + 1)}" for x in obj) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False)


def write_result(result: dict, folder: Path, host_label: str | None = None) -> Path:
    """Write ``<suite>.json`` into ``folder``; with ``host_label``, ``<suite>@<host_label>.json`` (the same
    suite measured on another machine, rendered as its own section by ``dspark bench report``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"{result['suite']}@{host_label}.json" if host_label else f"{result['suite']}.json")
    path.write_text(to_json(for_file(result)) + "\n")
    return path

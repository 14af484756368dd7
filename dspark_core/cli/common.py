"""Helpers every ``dspark`` verb shares: the user-facing error, settings, the target options, the table
printer.

Command plugins of the other packages (registry, flows, serving) never import this package; the entry
point hands them a :class:`CommandKit` instead (``add_commands(sub, kit)``).
"""

from __future__ import annotations

import argparse
import os
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

# torch-backed modules are imported inside the functions that use them: the CLI parses its arguments and
# answers --help, and the registry and flow verbs run, without loading torch.

class CliError(Exception):
    """A user-facing error: one line, plus a hint."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Settings:
    """What the CLI reads from the environment, in one place."""

    home: Path

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(home=Path(os.environ.get("DSPARK_HOME", "./.dspark")).expanduser())


def log(msg: str) -> None:
    """Progress and notes go to stderr, so that stdout holds only the record a verb prints."""
    print(msg, file=sys.stderr, flush=True)


def cell(value: Any, max_width: int | None = None) -> str:
    """One value as table text: None as ``-``, floats to 4 significant digits (whole numbers from 1000
    up), lists space-separated, mappings as ``key=value``; longer than ``max_width`` ends in ``...``."""
    if value is None:
        text = "-"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = str(value) if not math.isfinite(value) else f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    elif isinstance(value, (list, tuple)):
        text = " ".join(cell(v) for v in value)
    elif isinstance(value, Mapping):
        text = ", ".join(f"{k}={cell(v)}" for k, v in value.items())
    else:
        text = str(value).replace("\r", "\\r").replace("\n", "\\n")
    if max_width is not None and len(text) > max_width:
        text = text[:max(max_width - 3, 0)] + "..."
    return text


def table(rows: Iterable[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str] | None = None, *,
          header: bool = True, max_width: int | None = None) -> str:
    """Rows as aligned plain-text columns, two spaces apart, for a person to read (``--json`` is for
    programs). ``rows`` are mappings (``columns`` picks and orders their keys; default: the first row's
    keys) or sequences (``columns`` names them). The header is the column names in capitals, underscores
    as spaces; ``header=False`` leaves it out (a two-column ``field value`` listing reads better without).
    Numeric columns are right-aligned; ``max_width`` cuts long cells. No rows and no header: ``""``."""
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows and isinstance(rows[0], Mapping) else []
    values = [[r.get(c) for c in columns] if isinstance(r, Mapping) else list(r) for r in rows]
    width = max([len(columns)] + [len(v) for v in values])
    values = [v + [None] * (width - len(v)) for v in values]
    names = [str(c).upper().replace("_", " ") for c in columns] + [""] * (width - len(columns))
    numeric = [all(isinstance(v[i], (int, float)) and not isinstance(v[i], bool) for v in values if v[i] is not None)
               and any(v[i] is not None for v in values) for i in range(width)]
    lines = ([names] if header and columns else []) + [[cell(x, max_width) for x in v] for v in values]
    if not lines:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(width)]
    out = []
    for line in lines:
        parts = [text.rjust(w) if num else text.ljust(w) for text, w, num in zip(line, widths, numeric)]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def load_target_from_args(args, settings: Settings, keep_reference: bool = False):
    """Resolve --target/--model, preparing the packaged default on first use."""
    from dspark_core.engine.inputs import resolve_dtype
    from dspark_core.model.target import DEFAULT_TARGET, load_target, prepare_local, prepare_smollm2, resolve_target_dir
    if args.device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"   # torchrun: one GPU per rank
    dtype = resolve_dtype(args.dtype, args.device)
    if getattr(args, "model", None):
        path = Path(args.model)
        if not path.exists():
            raise CliError(f"--model {path} does not exist", "give a local Hugging Face checkpoint folder")
        target_dir = prepare_local(path, settings.home, log=log)
    elif args.target == DEFAULT_TARGET and not (settings.home / "targets" / DEFAULT_TARGET).exists():
        target_dir = prepare_smollm2(settings.home, log=log)
    else:
        target_dir = resolve_target_dir(args.target, settings.home)
    return load_target(target_dir, dtype=dtype, device=args.device, keep_reference=keep_reference)


def add_target_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """--target/--model/--dtype/--device. Verbs whose output a user reads default to float32: there
    speculative greedy output is token-for-token the plain output. In bf16 a verify forward over several
    tokens rounds differently from a one-token step, so a near-tie can flip; benchmarks use auto."""
    from dspark_core.model.target import DEFAULT_TARGET
    p.add_argument("--target", default=DEFAULT_TARGET, help="prepared target name or folder (default: %(default)s)")
    p.add_argument("--model", help="a local HF Llama/Qwen2/Qwen3 checkpoint folder (registered on first use)")
    p.add_argument("--dtype", default=dtype, choices=["auto", "float32", "bfloat16"],
                   help="auto = bf16 on CUDA or CPUs with native bf16, else fp32 (default: %(default)s; "
                        "float32 is exact, bf16 is faster but batch-shape rounding can flip near-ties)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")


def load_examples(home: Path, domains: list[str], split: str, fingerprint: str):
    from dspark_core.data.bootstrap import training_records
    from dspark_core.training.train import examples_from_records
    records = []
    for d in domains:
        try:
            records += training_records(home, d, split, fingerprint)
        except FileNotFoundError as e:
            raise CliError(f"no traces for domain {d!r} ({e})", "run: dspark traces bootstrap --domains " + d)
    if not records:
        raise CliError(f"no {split} traces for {','.join(domains)} and this target",
                       "run: dspark traces bootstrap")
    return examples_from_records(records), records


@dataclass(frozen=True)
class CommandKit:
    """What the entry point hands each command plugin (``add_commands(sub, kit)``) and each plugin bench
    suite, so that no package outside ``dspark_core.cli`` imports it. Plugins read it back from
    ``args.kit`` (the parser's default) when their verb runs."""

    error: type[CliError]                                   # raise kit.error(message, hint)
    add_target_args: Callable[..., None]                    # (parser, dtype="float32")
    load_target: Callable                                   # (args, settings, keep_reference=False) -> Target
    log: Callable[[str], None]                              # a progress line to stderr
    table: Callable[..., str]                               # (rows, columns=None, *, header, max_width) -> text


KIT = CommandKit(error=CliError, add_target_args=add_target_args, load_target=load_target_from_args, log=log,
                 table=table)

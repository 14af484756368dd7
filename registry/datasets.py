"""Hugging Face datasets built from warehouse queries, with the recorded train / held-out split kept.

The split is the one ``dspark traces bootstrap`` recorded in ``<home>/splits/<domain>.json``
(:func:`dspark_core.data.bootstrap.load_split`); it is keyed on ``prompt_id`` and never changes once written.
A trace whose prompt has no recorded assignment is left out of every split (it could be a held-out prompt
seen under another id, so it must never reach training); how many were left out is reported.

Rows: ``request_id``, ``domain``, ``prompt_id``, ``input_ids`` (prompt then completion token ids) and
``response_start`` (index of the first completion token), in the warehouse order (timestamp, request id),
deduplicated on ``(prompt_id, completion_ids)`` (first kept). The build report (counts, filters) is JSON
in ``ds.info.description``; :func:`dataset_report` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from types import SimpleNamespace
from pathlib import Path

import datasets

from dspark_core.data.bootstrap import SPLITS, load_split, record_split
from dspark_core.data.traces import write_jsonl
from dspark_core.training.train import Example

from .warehouse import TraceWarehouse, dedup_records

FEATURES = datasets.Features({
    "request_id": datasets.Value("string"),
    "domain": datasets.Value("string"),
    "prompt_id": datasets.Value("string"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "response_start": datasets.Value("int32"),
})


def build_dataset(warehouse: TraceWarehouse, domain: str, split: str, home: Path | str,
                  target_fingerprint: str | None = None, since: datetime | str | None = None,
                  until: datetime | str | None = None) -> datasets.Dataset:
    """The ``split`` ("train" or "heldout") traces of ``domain`` in the window ``[since, until)``,
    optionally of one target fingerprint. Raises FileNotFoundError (with a hint) when the domain has
    no recorded split. The report in ``ds.info.description`` counts ``records`` (matching the filters,
    any split), ``in_split``, ``other_split``, ``unsplit_excluded``, ``duplicates_dropped`` and ``rows``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    assignments = load_split(Path(home), domain)["assignments"]
    matching = warehouse.records(domain=domain, since=since, until=until,
                                 target_fingerprint=target_fingerprint, dedup=False)
    in_split = [r for r in matching if assignments.get(r.prompt_id) == split]
    unsplit = sum(1 for r in matching if r.prompt_id not in assignments)
    kept = dedup_records(in_split)
    rows = [{"request_id": r.request_id, "domain": r.domain, "prompt_id": r.prompt_id,
             "input_ids": list(r.prompt_ids) + list(r.completion_ids), "response_start": len(r.prompt_ids)}
            for r in kept]
    report = {"domain": domain, "split": split, "target_fingerprint": target_fingerprint,
              "since": None if since is None else str(since), "until": None if until is None else str(until),
              "records": len(matching), "in_split": len(in_split),
              "other_split": len(matching) - len(in_split) - unsplit, "unsplit_excluded": unsplit,
              "duplicates_dropped": len(in_split) - len(kept), "rows": len(rows)}
    info = datasets.DatasetInfo(description=json.dumps(report), features=FEATURES)
    # from_dict rather than from_list: an empty list of rows would lose the columns
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in FEATURES}, features=FEATURES, info=info)


def dataset_report(ds: datasets.Dataset) -> dict:
    """The build report of a dataset made by :func:`build_dataset` (see its docstring)."""
    try:
        return json.loads(ds.info.description)
    except (TypeError, ValueError):
        raise ValueError("this dataset carries no dspark build report (not made by build_dataset)") from None


def examples_from_dataset(ds: datasets.Dataset) -> list[Example]:
    """Training examples (token ids, response start, domain) in dataset order."""
    missing = [c for c in ("input_ids", "response_start", "domain") if c not in ds.column_names]
    if missing:
        raise ValueError(f"dataset lacks column(s) {', '.join(missing)}; build it with build_dataset")
    return [Example(token_ids=list(r["input_ids"]), response_start=int(r["response_start"]), domain=r["domain"])
            for r in ds]


@dataclass(frozen=True)
class Snapshot:
    """One domain's frozen train and held-out traces: ``data_key`` (a hash of the target and both splits'
    request ids), the two JSONL paths and their record counts, ``trace_window`` (first/last timestamp) and
    how many prompts got their split assigned by this snapshot."""

    domain: str
    data_key: str
    train: str
    heldout: str
    train_count: int
    heldout_count: int
    trace_window: str
    new_prompts_assigned: int

    def to_dict(self) -> dict:
        return asdict(self)


# Nine parameters: the warehouse, home and output folder, then what is selected (domain, target, time
# window) and the split rule for prompts that have none yet (fraction, seed).
def snapshot_splits(warehouse_path: Path | str, home: Path | str, domain: str, target_fingerprint: str,
                    out_root: Path | str, since: datetime | str | None = None, until: datetime | str | None = None,
                    heldout_fraction: float = 0.1, seed: int = 0) -> Snapshot:
    """Freeze the train and held-out traces of ``domain`` (one target, window ``[since, until)``) into
    ``<out_root>/<domain>-<data_key>/{train,heldout}.jsonl`` (trace records, deduplicated as in
    :func:`build_dataset`), so that every step of a pipeline run reads the same data.

    Prompts that have no recorded split yet (e.g. new serving traffic) are assigned first, by the
    domain's recorded hash rule (``heldout_fraction`` and ``seed`` only when no split file exists), so
    new traces can train without ever moving a held-out prompt. ``data_key`` hashes the target and the
    request ids of both splits: the same traces give the same key (and folder).
    """
    with TraceWarehouse(Path(warehouse_path), read_only=True) as wh:
        matching = wh.records(domain=domain, since=since, until=until, target_fingerprint=target_fingerprint,
                              dedup=True)
    if not matching:
        raise ValueError(f"the warehouse holds no traces of domain {domain!r} for target {target_fingerprint[:12]}; "
                         f"land traces (dspark traces bootstrap, or serving) and ingest them first")
    prompts = {r.prompt_id: SimpleNamespace(prompt_id=r.prompt_id) for r in matching}
    try:
        known = set(load_split(Path(home), domain)["assignments"])
    except FileNotFoundError:
        known = set()
    assignments = record_split(Path(home), domain, prompts.values(), heldout_fraction, seed)["assignments"]
    parts = {s: [r for r in matching if assignments.get(r.prompt_id) == s] for s in SPLITS}
    key = hashlib.sha256(json.dumps([target_fingerprint, {s: [r.request_id for r in parts[s]] for s in SPLITS}])
                         .encode()).hexdigest()[:12]
    folder = Path(out_root) / f"{domain}-{key}"
    paths = {s: folder / f"{s}.jsonl" for s in SPLITS}
    if not all(p.exists() for p in paths.values()):
        folder.mkdir(parents=True, exist_ok=True)
        for s in SPLITS:                    # write-then-rename: a crash never leaves half a snapshot
            tmp = paths[s].with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            write_jsonl(parts[s], tmp, append=False)
            tmp.replace(paths[s])
    stamps = sorted(r.timestamp for r in matching)
    return Snapshot(domain=domain, data_key=key, train=str(paths["train"]), heldout=str(paths["heldout"]),
                    train_count=len(parts["train"]), heldout_count=len(parts["heldout"]),
                    trace_window=f"{stamps[0]}/{stamps[-1]}", new_prompts_assigned=len(set(prompts) - known))

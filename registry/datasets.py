"""Hugging Face datasets built from warehouse queries, with the recorded train / held-out split kept.

The split is the one ``dspark traces bootstrap`` recorded in ``<home>/splits/<domain>.json``
(:func:`dspark_core.bootstrap.load_split`); it is keyed on ``prompt_id`` and never changes once written.
A trace whose prompt has no recorded assignment is left out of every split (it could be a held-out prompt
seen under another id, so it must never reach training); how many were left out is reported.

Rows: ``request_id``, ``domain``, ``prompt_id``, ``input_ids`` (prompt then completion token ids) and
``response_start`` (index of the first completion token), in the warehouse order (timestamp, request id),
deduplicated on ``(prompt_id, completion_ids)`` (first kept). The build report (counts, filters) is JSON
in ``ds.info.description``; :func:`dataset_report` reads it back.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import datasets

from dspark_core.bootstrap import SPLITS, load_split
from dspark_core.train import Example

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

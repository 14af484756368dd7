"""The verify-length policy the engine runs: scheduled (load-aware, SPS(B) per concurrency), fixed, none.

SPS(B) tables come, in this order, from ``--sps`` (a ``dspark profile-sps`` JSON, or
``{"tables": {"<rows>": profile, ...}}`` for one table per concurrency), from the ``sps.json`` registered
with a loaded drafter, or from a short profile at start-up (one row, the drafter's block). A registered
profile measured on other hardware (another device, dtype, CPU model or ISA, thread count) is passed over
for the start-up profile, with a warning; an explicit ``--sps`` is used as asked, with the same warning.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

from dspark_core.model.runner import TargetRunner
from dspark_core.scheduling import (GATE_EXPLORE_BUDGET, GATE_HURDLE, LiveGate, ScheduledPolicy, SPSTable, StepCost,
                                    VerifyPolicy, make_length_gate, make_policy)
from dspark_core.scheduling.sps import hardware_fingerprint, hardware_mismatch, profile_sps

from .drafters import LoadedDrafter

log = logging.getLogger("dspark.serving.policy")
FIXED_ALL = 1 << 16         # "fixed": verify every drafted token


def sps_tables(obj: dict) -> dict[int, SPSTable]:
    """One profile (``{"sps": [...], "rows": R}``) or ``{"tables": {"R": profile | [sps...]}}``."""
    if "tables" in obj:
        out = {}
        for rows, prof in obj["tables"].items():
            sps = prof["sps"] if isinstance(prof, dict) else prof
            out[int(rows)] = SPSTable(tuple(float(x) for x in sps))
        return out
    if "sps" in obj:
        return {int(obj.get("rows") or 1): SPSTable(tuple(float(x) for x in obj["sps"]))}
    raise ValueError("an SPS file needs 'sps' (one profile) or 'tables' (one profile per concurrency)")


def step_costs(obj: dict) -> dict[int, StepCost]:
    """The split step costs (drafting apart from the verify forward) of the profiles in ``obj`` that have
    them (profiles from before the split, or bare SPS lists, have none: SPS(B) alone decides there)."""
    profs = ({int(r): p for r, p in obj["tables"].items() if isinstance(p, dict)} if "tables" in obj
             else {int(obj.get("rows") or 1): obj})
    out = {}
    for rows, prof in profs.items():
        cost = StepCost.from_profile({**prof, "rows": prof.get("rows") or rows})
        if cost is not None:
            out[rows] = cost
    return out


def profile_mismatch(obj: dict, runner: TargetRunner) -> list[str]:
    """How the hardware the profile(s) in ``obj`` were measured on differs from this runner's (a bare
    list of SPS values records none and matches)."""
    here = hardware_fingerprint(runner)
    profs = obj["tables"].values() if "tables" in obj else [obj]
    return sorted({m for p in profs if isinstance(p, dict) for m in hardware_mismatch(p.get("hardware"), here)})


def _resolve_profiles(sps_path: Path | None, drafters: list[LoadedDrafter],
                      runner: TargetRunner) -> tuple[dict[int, SPSTable], dict[int, StepCost], str]:
    """The SPS(B) tables, the split step costs and where they came from (see the module docstring)."""
    if sps_path is not None:            # asked for explicitly: used, with any hardware difference said
        obj = json.loads(Path(sps_path).read_text())
        other = profile_mismatch(obj, runner)
        if other:
            log.warning("--sps %s was profiled on other hardware (%s); using it as asked", sps_path, "; ".join(other))
        return sps_tables(obj), step_costs(obj), str(sps_path) + (" (other hardware)" if other else "")
    for d in drafters:
        if d.sps:
            try:
                other = profile_mismatch(d.sps, runner)
                if other:       # a curve from another machine or dtype would mislead the scheduler
                    raise ValueError(f"profiled on other hardware ({'; '.join(other)})")
                return sps_tables(d.sps), step_costs(d.sps), f"registry sps.json of {d.label}"
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring the SPS profile of %s: %s", d.label, e)
    prop = drafters[0].proposer if drafters else None
    block = prop.max_block if prop is not None else 7
    log.info("profiling SPS(B) at start-up (one row, B = 1..%d); pass --sps for per-concurrency tables", block + 1)
    prof = profile_sps(runner, prop, block + 1, reps=2, context=128, block=block, rows=1)
    return {1: SPSTable(tuple(prof["sps"]))}, step_costs(prof), "start-up profile (one row)"


class ServingPolicy(NamedTuple):
    """The policy the engine runs, the SPS(B) tables behind it (the engine's scheduler metrics read them)
    and a one-line description for the logs and the admin API."""

    policy: VerifyPolicy
    tables: dict[int, SPSTable]
    description: str


def build_policy(name: str, drafters: list[LoadedDrafter], runner: TargetRunner, sps_path: Path | None = None,
                 live_gate: bool = True, gate_hurdle: float = GATE_HURDLE,
                 gate_explore_budget: float = GATE_EXPLORE_BUDGET, length_gate: bool = True) -> ServingPolicy:
    """``none`` (no speculation), ``fixed`` (verify every drafted token) or ``scheduled`` (SPS(B) per
    concurrency, behind the live gate unless ``live_gate`` is off; inside it, unless ``length_gate`` is
    off, the scheduler's lengths are measured against verifying every drafted token)."""
    k = max((d.proposer.max_block for d in drafters), default=0) or 7
    if name == "none":
        return ServingPolicy(make_policy("fixed", k=0), {}, "no speculation")
    if name == "fixed":
        return ServingPolicy(make_policy("fixed", k=FIXED_ALL), {}, "fixed: verify the whole drafted block")
    tables, costs, where = _resolve_profiles(sps_path, drafters, runner)
    policy = ScheduledPolicy(tables, k=k, costs=costs)
    if live_gate:
        inner = make_length_gate(policy, explore_budget=gate_explore_budget) if length_gate else policy
        return ServingPolicy(LiveGate(inner, hurdle=gate_hurdle, explore_budget=gate_explore_budget), tables,
                             f"scheduled, SPS(B) from {where}, live gate (speculation above one row needs "
                             f"{1 + gate_hurdle:.2f}x{'; scheduled lengths against verify-all' if length_gate else ''})")
    return ServingPolicy(policy, tables, f"scheduled, SPS(B) from {where}")

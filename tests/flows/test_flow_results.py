"""The dataclasses the flows pass around, as JSON: what a cached task persists reads back unchanged, a
result persisted in the plain-dict form (the same keys) still resumes a run, and every result pickles
(Prefect may pickle task results). No flow runs here."""

import json
import pickle

import pytest

from dspark_core.pipeline.steps import (CalibrationSummary, DrafterEval, EvalSummary, LosslessSummary,
                                        ProfileSummary, TrainSummary)
from flows.handoff import ReloadResult
from flows.report import render
from flows.results import Baseline, Challenger, DomainOutcome, DriftReport, DriftVerdict, RetrainSummary, WarmStart
from registry.warehouse import IngestResult, IngestSummary, LandingIngest, LiveAcceptance, WarehouseTotals

DRAFTER = {"drafter": "dspark", "temperature": 0.0, "prompts": 3, "tau": 2.5, "tau_median_prompt": 2.4,
           "acceptance_per_position": [0.9, 0.6, 0.3, 0.1], "tokens": 72, "seconds": 1.5, "tok_s": 48.0,
           "round_ms": {"draft": 1.0, "verify": 9.0}, "speedup": 1.3}
# The JSON each cached step persists, key for key (a resumed run reads these back).
PERSISTED = {
    TrainSummary: {"checkpoint": "/w/drafters/code/k", "steps": 20, "resumed_from": 0, "seconds": 3.1,
                   "examples": 18, "final": {"loss": 2.1, "tau_expected": 1.7}},
    CalibrationSummary: {"calibration": "/w/c.json", "plot": "/w/c.png", "rounds": 40, "temperatures": [1.2, 1.1],
                         "shifts": [0.0, 0.1], "fallback": False, "ece_raw": [0.1, 0.2], "ece_calibrated": [0.05, 0.04],
                         "auroc": [0.7, 0.6]},
    EvalSummary: {**DRAFTER, "plain_tok_s": 37.0,
                  "baseline": {**DRAFTER, "tau": 2.2, "speedup": 1.2, "checkpoint": "/w/champions/code/v1"}},
    LosslessSummary: {"prompts": 2, "failures": 0, "failed_prompts": [], "dtype": "float32"},
    ProfileSummary: {"sps": "/w/sps.json", "plot": "/w/sps.png", "table": [50.0, 49.0, 47.5], "seconds": 0.8},
    WarmStart: {"init": "champion", "version": 3},
}


@pytest.mark.parametrize("cls", list(PERSISTED), ids=lambda c: c.__name__)
def test_a_persisted_step_result_reads_back_unchanged(cls):
    d = PERSISTED[cls]
    obj = cls.from_dict(json.loads(json.dumps(d)))
    assert obj.to_dict() == d and cls.from_dict(obj.to_dict()) == obj
    assert pickle.loads(pickle.dumps(obj)) == obj


def test_evaluation_without_a_baseline_and_the_generic_warm_start_keep_their_keys():
    plain = {**DRAFTER, "plain_tok_s": 37.0}
    ev = EvalSummary.from_dict(plain)
    assert ev.baseline is None and ev.drafter == DrafterEval(**DRAFTER) and ev.to_dict() == plain
    assert WarmStart.from_dict({"init": "generic"}) == WarmStart("generic")
    assert WarmStart("generic").to_dict() == {"init": "generic"}


def _summary(tmp_path) -> RetrainSummary:
    ingest = LandingIngest.of(IngestSummary([IngestResult(5, 4, 1, 0, False, "a.jsonl")]),
                              WarehouseTotals(5, 4, 1, 0, 4, 1), ["code"])
    live = LiveAcceptance("code", 2, 10, 40, 40, 5, 0.125, 1.5)
    cal = CalibrationSummary.from_dict(PERSISTED[CalibrationSummary])
    challenger = Challenger("/w/ck", "/w/heldout.jsonl", calibration=cal, tags={"warm_start": "champion-v1"})
    outcome = DomainOutcome("code", 2, "models:/dspark-drafter-code/2", "promoted", True, ["tau 2.5 >= 2.2"],
                            Baseline(1, 2.2, 1.2, [0.1, 0.2], [0.05, 0.06]), {"tau": 2.5, "speedup": 1.3,
                            "ece_calibrated": cal.ece_calibrated, "lossless_failures": 0},
                            challenger.reliability_plot, challenger.sps_plot,
                            ReloadResult(False, "http://127.0.0.1:1/admin/drafters/code/reload", error="ConnectError"),
                            warm_start="champion-v1")
    drift = DriftReport(["code"], {"code": DriftVerdict("drift: ...", live, 1, 2.2),
                                   "math": DriftVerdict("no champion with an evaluated tau")}, "2025-01-01", 0.1)
    return RetrainSummary("tiny", "f" * 64, ["code"], ingest, drift, {"code": outcome}, {}, 12.5,
                          str(tmp_path / "r.md"))


def test_the_retrain_summary_as_json_keeps_the_keys_the_cli_printed(tmp_path):
    summary = _summary(tmp_path)
    d = json.loads(json.dumps(summary.to_dict()))
    assert d["ingest"] == {"files": 1, "skipped_files": 0, "read": 5, "stored": 4, "quarantined": 1, "duplicates": 0,
                           "total_records": 5, "total_stored": 4, "total_quarantined": 1, "total_duplicates": 0,
                           "total_trace_rows": 4, "total_quarantine_rows": 1, "trace_rows": 4, "domains": ["code"]}
    assert d["drift"]["details"]["math"] == {"verdict": "no champion with an evaluated tau"}
    assert d["drift"]["details"]["code"]["live"]["tau"] == 1.5 and d["drift"]["drifted"] == ["code"]
    out = d["results"]["code"]
    assert set(out) == {"domain", "version", "model_uri", "decision", "promoted", "reasons", "before", "after",
                        "reliability_plot", "sps_plot", "handoff", "warm_start"}
    assert out["before"]["tau"] == 2.2 and out["handoff"] == {"ok": False, "url": summary.results["code"].handoff.url,
                                                             "error": "ConnectError"}
    assert pickle.loads(pickle.dumps(summary)) == summary


def test_the_report_renders_a_summary(tmp_path):
    md = render(_summary(tmp_path))
    assert "| code | v2 | promoted | 2.200 | 2.500 | 1.20x | 1.30x | - | 0.0500 | 0 |" in md
    assert "drift check: retraining code" in md and "serving reload: FAILED (ConnectError)" in md

"""Serving's policy wiring: SPS de-spiking, domain routing, drafter caps, gate settings."""

from dspark_core.scheduling import LiveGate
from serving.bench import smooth_sps
from serving.policy import sps_tables
from serving.router import classify, resolve_domain


def test_smooth_sps_removes_a_spike_but_keeps_the_drafting_jump():
    ms = [29.0, 29.0, 29.0, 29.0, 40.7, 38.8, 40.6, 300.0, 41.0, 46.3, 46.0, 46.2]      # step ms, rows = 4
    sps = smooth_sps([1000 / m for m in ms], 4)
    assert abs(1000 / sps[3] - 29.0) < 1e-9                  # B = rows: no drafting, as measured
    assert 1000 / sps[4] > 38.0                              # the first drafting pass costs what it costs
    assert max(1000 / s for s in sps) < 50.0                 # the 300 ms spike is gone
    assert all(a >= b for a, b in zip(sps, sps[1:]))         # non-increasing


def test_sps_tables_accept_one_profile_or_one_per_concurrency():
    one = sps_tables({"sps": [10.0, 9.0], "rows": 2})
    assert list(one) == [2] and one[2](1) == 10.0
    many = sps_tables({"tables": {"1": {"sps": [5.0]}, "4": [4.0, 3.0]}})
    assert sorted(many) == [1, 4] and many[4](2) == 3.0


def test_routing_order_and_classifier():
    domains = ["code", "math", "chat"]
    assert classify("def f(x):\n    return x", domains, "chat") == "code"
    assert classify("What is 12 * 7? Solve it.", domains, "chat") == "math"
    assert classify("tell me about your weekend", domains, "chat") == "chat"
    assert classify("def f(x): return x", ["chat"], "chat") == "chat"          # only served domains count
    assert resolve_domain("m:math", None, "def f(): pass", domains, "chat") == ("math", "model")
    assert resolve_domain("m:math", "code", "", domains, "chat") == ("code", "field")
    assert resolve_domain("m", "Poetry", "", domains, "chat") == ("chat", "unknown:poetry")


def test_max_draft_tokens_caps_a_block_drafter_and_never_exceeds_its_block(tmp_path):
    from dspark_core.drafters import build_drafter, drafter_config, save_drafter
    from serving.drafters import LocalSource
    from serving_helpers import make_tiny_target
    t = make_tiny_target()
    cfg = drafter_config("dspark", t.runner.arch, "tiny", block_size=4)
    save_drafter(build_drafter(cfg, t.runner, seed=0), tmp_path / "code", t.fingerprint)
    assert LocalSource(tmp_path, t.runner, t.fingerprint).load("code").proposer.max_block == 4
    assert LocalSource(tmp_path, t.runner, t.fingerprint, max_draft=2).load("code").proposer.max_block == 2
    assert LocalSource(tmp_path, t.runner, t.fingerprint, max_draft=9).load("code").proposer.max_block == 4
    # --prompt-lookup: the same drafter behind prompt lookup, the cap passed through to it
    looked = LocalSource(tmp_path, t.runner, t.fingerprint, max_draft=2, lookup=True).load("code")
    assert type(looked.proposer).__name__ == "LookupFirstProposer" and looked.proposer.max_block == 2
    assert looked.kind == "dspark" and looked.proposer.inner.max_block == 2


def test_serve_gate_hurdle_reaches_the_settings_and_bad_values_are_refused(tmp_path):
    import argparse

    import pytest

    from dspark_core.cli.common import KIT
    from serving.cli import add_serve_args, settings_from_args
    from serving.settings import ServeSettings
    p = argparse.ArgumentParser()
    add_serve_args(p, KIT)
    env = {"DSPARK_HOME": str(tmp_path)}
    assert settings_from_args(p.parse_args(["--no-registry"]), env).gate_hurdle == 0.04
    assert settings_from_args(p.parse_args(["--no-registry", "--gate-hurdle", "0.1"]), env).gate_hurdle == 0.1
    with pytest.raises(ValueError, match="gate_hurdle"):
        ServeSettings(gate_hurdle=1.5)
    assert settings_from_args(p.parse_args(["--no-registry"]), env).gate_explore_budget == 0.02
    got = settings_from_args(p.parse_args(["--no-registry", "--gate-explore-budget", "0"]), env)
    assert got.gate_explore_budget == 0.0
    with pytest.raises(ValueError, match="gate_explore_budget"):
        ServeSettings(gate_explore_budget=-0.1)
    assert settings_from_args(p.parse_args(["--no-registry"]), env).live_request_prior == 0.0
    assert settings_from_args(p.parse_args(["--no-registry", "--live-request-prior", "10"]), env).live_request_prior == 10
    with pytest.raises(ValueError, match="live_request_prior"):
        ServeSettings(live_request_prior=-1.0)
    import json
    from serving.policy import build_policy
    from serving_helpers import make_tiny_target
    (tmp_path / "sps.json").write_text(json.dumps({"sps": [50.0, 45.0, 40.0], "rows": 1}))
    gate, _, _ = build_policy("scheduled", [], make_tiny_target().runner, tmp_path / "sps.json",
                              gate_hurdle=0.1, gate_explore_budget=0.05)
    assert isinstance(gate, LiveGate) and gate.hurdle == 0.1 and gate.explore_budget == 0.05
    # inside it the length gate (scheduled lengths against verify-all), unless --no-length-gate
    assert isinstance(gate.inner, LiveGate) and gate.inner.alt is not None and gate.inner.hurdle == 0.0
    assert settings_from_args(p.parse_args(["--no-registry"]), env).length_gate
    off = settings_from_args(p.parse_args(["--no-registry", "--no-length-gate"]), env)
    assert not off.length_gate
    plain_gate, _, desc = build_policy("scheduled", [], make_tiny_target().runner, tmp_path / "sps.json",
                                       length_gate=off.length_gate)
    assert not isinstance(plain_gate.inner, LiveGate) and "verify-all" not in desc


def test_a_registered_sps_profile_from_other_hardware_is_passed_over(tmp_path, caplog):
    """A registered SPS(B) curve measured on another CPU / dtype / device would mislead the scheduler: it is
    passed over for a start-up profile, with a warning; an explicit --sps is used as asked, flagged."""
    import json
    import logging
    from dspark_core.drafters import build_drafter, drafter_config, save_drafter
    from dspark_core.scheduling.sps import hardware_fingerprint, hardware_mismatch
    from serving.drafters import LocalSource
    from serving.policy import build_policy
    from serving_helpers import make_tiny_target
    t = make_tiny_target()
    save_drafter(build_drafter(drafter_config("dspark", t.runner.arch, "tiny", block_size=3), t.runner, seed=0),
                 tmp_path / "code", t.fingerprint)
    d = LocalSource(tmp_path, t.runner, t.fingerprint).load("code")
    here = hardware_fingerprint(t.runner)
    assert here["cpu"] and isinstance(here["isa"], list)
    curve = [50.0, 45.0, 40.0, 35.0]
    for hardware, registry_used in ((here, True), (None, True), ({**here, "cpu": "Some Other CPU"}, False),
                                    ({**here, "dtype": "bfloat16" if here["dtype"] != "bfloat16" else "float32"},
                                     False), ({**here, "isa": here["isa"] + ["amx_bf16_x"]}, False)):
        d.sps = {"sps": curve, "rows": 1, **({"hardware": hardware} if hardware else {})}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dspark.serving.policy"):
            _, tables, desc = build_policy("scheduled", [d], t.runner)
        assert ("registry sps.json of" in desc) is registry_used, desc
        assert (tables[1].sps == tuple(curve)) is registry_used
        assert ("other hardware" in caplog.text) is (not registry_used)
    # explicit --sps: used as asked, said to be from other hardware
    path = tmp_path / "sps.json"
    path.write_text(json.dumps({"tables": {"1": {"sps": curve, "hardware": {**here, "threads": 99}}}}))
    _, tables, desc = build_policy("scheduled", [d], t.runner, sps_path=path)
    assert tables[1].sps == tuple(curve) and "(other hardware)" in desc
    # the device is compared by type; fields an older profile lacks are not compared
    assert hardware_mismatch({"device": "cuda:1", "dtype": "bfloat16"}, {"device": "cuda:0", "dtype": "bfloat16",
                                                                         "cpu": "X"}) == []
    assert hardware_mismatch({"threads": 2}, {"threads": 16}) == ["threads: 2 != 16"]

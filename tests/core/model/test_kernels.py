"""The packing choice: measured on this host at load, cached by hardware, overridable, and followed."""

import json

import pytest
import torch

from dspark_core.model import kernels, layers
from dspark_core.model.kernels import choose_packing
from dspark_core.model.layers import Linear, packing_enabled, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported("cpu", torch.float32), reason="no oneDNN packing here")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(layers, "_PACKING", {})
    monkeypatch.delenv("DSPARK_PACKED_LINEAR", raising=False)


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(96, 64, generator=g), torch.randn(64, 96, generator=g)]


def test_measured_once_then_read_from_the_cache(tmp_path):
    first = choose_packing(_weights(), tmp_path)
    assert first.source == "measured" and first.ratio is not None and first.ratio > 0
    assert first.packed == (first.ratio < 1 - kernels.MIN_GAIN)
    files = list(tmp_path.glob("packing-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["hardware"]["dtype"] == "float32"
    again = choose_packing(_weights(), tmp_path)
    assert (again.source, again.packed, again.ratio) == ("cache", first.packed, first.ratio)
    # a cache written on other hardware is not reused
    d = json.loads(files[0].read_text())
    d["hardware"]["cpu"] = "another cpu"
    files[0].write_text(json.dumps(d))
    assert choose_packing(_weights(), tmp_path).source == "measured"


@pytest.mark.parametrize("packed", [True, False])
def test_later_linears_follow_the_choice(tmp_path, packed):
    d = {"device": "cpu", "dtype": "float32", "packed": packed, "ratio": 0.5 if packed else 1.2,
         "source": "measured"}
    choice = choose_packing(_weights(), tmp_path)
    (next(tmp_path.glob("packing-*.json"))).write_text(json.dumps({**d, "hardware": choice.hardware}))
    layers._PACKING.clear()
    assert choose_packing(_weights(), tmp_path).packed is packed
    assert packing_enabled("cpu", torch.float32) is packed
    lin = Linear(_weights()[0])
    assert (lin.packed is not None) is packed
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ _weights()[0].T, rtol=1e-4, atol=1e-4)


def test_the_environment_overrides_the_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "0")
    choice = choose_packing(_weights(), tmp_path)
    assert (choice.source, choice.packed) == ("env", False) and not list(tmp_path.glob("*.json"))
    assert not packing_enabled("cpu", torch.float32)
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "1")
    layers.set_packing("cpu", torch.float32, False)
    assert packing_enabled("cpu", torch.float32)          # the variable wins over a recorded choice

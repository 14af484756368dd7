"""The linear kernel choice: measured on this host at load, cached by hardware, overridable, and followed."""

import json

import pytest
import torch

from dspark_core.model import kernels, layers
from dspark_core.model.kernels import choose_kernel, pick, pick_pair
from dspark_core.model.layers import Linear, linear_kernel, linear_kernels, packing_enabled, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported("cpu", torch.float32), reason="no oneDNN packing here")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(layers, "_KERNEL", {})
    monkeypatch.delenv("DSPARK_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("DSPARK_LINEAR_KERNEL", raising=False)


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(96, 64, generator=g), torch.randn(64, 96, generator=g)]


def test_measured_once_then_read_from_the_cache(tmp_path):
    first = choose_kernel(_weights(), tmp_path, total_bytes=1 << 20)
    assert first.source == "measured" and set(first.ratios) == {"one", "many"}
    assert all(set(r) == {"packed", "transposed"} and min(r.values()) > 0 for r in first.ratios.values())
    assert (first.kernel, first.multi_kernel) == (pick(first.ratios["one"]), pick(first.ratios["many"]))
    assert linear_kernels("cpu", torch.float32) == (first.kernel, first.multi_kernel)
    files = list(tmp_path.glob("kernel-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["hardware"]["dtype"] == "float32"
    again = choose_kernel(_weights(), tmp_path, total_bytes=1 << 20)
    assert (again.source, again.kernel, again.multi_kernel, again.ratios) == (
        "cache", first.kernel, first.multi_kernel, first.ratios)
    # a cache written on other hardware is not reused
    d = json.loads(files[0].read_text())
    d["hardware"]["cpu"] = "another cpu"
    files[0].write_text(json.dumps(d))
    assert choose_kernel(_weights(), tmp_path, total_bytes=1 << 20).source == "measured"


def test_the_fastest_kernel_wins_only_by_a_margin():
    assert pick({"packed": 0.8, "transposed": 0.9}) == "packed"
    assert pick({"packed": 1.3, "transposed": 0.85}) == "transposed"
    assert pick({"packed": 1 - kernels.MIN_GAIN / 2, "transposed": 1.1}) == "linear"     # a tie keeps F.linear
    assert pick({}) == "linear"
    # one kernel may win one-token steps and another verify blocks (fp32 on the AMX host of docs/engine.md)
    ratios = {"one": {"packed": 1.09, "transposed": 0.78}, "many": {"packed": 0.63, "transposed": 0.75}}
    assert pick_pair(ratios, two_copies=True) == ("transposed", "packed")
    assert pick_pair(ratios, two_copies=False) == ("transposed", "transposed")      # mean 0.765 against 0.86
    ratios["many"]["packed"] = 0.40
    assert pick_pair(ratios, two_copies=False) == ("packed", "packed")              # mean 0.745 against 0.765


def test_two_copies_only_where_memory_allows(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "measure_kernels", lambda w, k, rows: {"packed": 1.1, "transposed": 0.8}
                        if rows == (1,) else {"packed": 0.6, "transposed": 0.8})
    monkeypatch.setattr(kernels, "_ram_bytes", lambda: 100 << 30)
    small = choose_kernel(_weights(), tmp_path, total_bytes=1 << 30)          # 1 GiB of 100: two copies fit
    assert (small.kernel, small.multi_kernel) == ("transposed", "packed") and small.packed
    assert small.name == "transposed (1 row) + prepacked (more rows)"
    lin = Linear(_weights()[0])
    assert lin.packed is not None and lin.wt is not None and lin.weight is None
    x = torch.randn(5, 64)
    torch.testing.assert_close(lin(x[:1]), x[:1] @ _weights()[0].T, rtol=1e-4, atol=1e-4)   # transposed
    torch.testing.assert_close(lin(x), x @ _weights()[0].T, rtol=1e-4, atol=1e-4)           # packed
    r = torch.randn(1, 96)
    torch.testing.assert_close(lin.add_to(r, x[:1]), r + x[:1] @ _weights()[0].T, rtol=1e-4, atol=1e-4)
    big = choose_kernel(_weights(), tmp_path, total_bytes=40 << 30)           # 40 GiB: one kernel for both
    assert big.kernel == big.multi_kernel == "transposed"                     # mean 0.8 against 0.85
    assert Linear(_weights()[0]).packed is None



@pytest.mark.parametrize("kernel", ["linear", "packed", "transposed"])
def test_later_linears_follow_the_choice(tmp_path, kernel):
    choice = choose_kernel(_weights(), tmp_path)
    d = {"device": "cpu", "dtype": "float32", "kernel": kernel, "multi_kernel": kernel,
         "ratios": {"one": {"packed": 0.9, "transposed": 0.95}}, "source": "measured", "hardware": choice.hardware}
    next(tmp_path.glob("kernel-*.json")).write_text(json.dumps(d))
    layers._KERNEL.clear()
    assert choose_kernel(_weights(), tmp_path).kernel == kernel
    assert linear_kernel("cpu", torch.float32) == kernel
    assert packing_enabled("cpu", torch.float32) is (kernel == "packed")
    w = _weights()[0]
    lin = Linear(w)
    assert lin.kernel == kernel
    assert (lin.packed is not None, lin.wt is not None, lin.weight is not None) == (
        kernel == "packed", kernel == "transposed", kernel == "linear")           # only the copy it reads is kept
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-4, atol=1e-4)


def test_a_cache_from_before_the_kernel_field_is_measured_again(tmp_path):
    choice = choose_kernel(_weights(), tmp_path)
    path = next(tmp_path.glob("kernel-*.json"))
    path.write_text(json.dumps({"device": "cpu", "dtype": "float32", "packed": True, "ratio": 0.5,
                                "source": "measured", "hardware": choice.hardware}))
    assert choose_kernel(_weights(), tmp_path).source == "measured"


def test_the_environment_overrides_the_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "0")
    choice = choose_kernel(_weights(), tmp_path)
    assert (choice.source, choice.kernel) == ("env", "linear") and not list(tmp_path.glob("*.json"))
    assert not packing_enabled("cpu", torch.float32)
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "1")
    layers.set_kernel("cpu", torch.float32, "linear", "linear")
    assert packing_enabled("cpu", torch.float32)          # the variable wins over a recorded choice
    monkeypatch.setenv("DSPARK_LINEAR_KERNEL", "transposed")      # and the kernel's name wins over both
    assert linear_kernel("cpu", torch.float32) == "transposed"
    assert choose_kernel(_weights(), tmp_path).kernel == "transposed"
    monkeypatch.setenv("DSPARK_LINEAR_KERNEL", "fastest")
    with pytest.raises(ValueError, match="DSPARK_LINEAR_KERNEL='fastest' is not a kernel; use one of linear"):
        linear_kernel("cpu", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_linear_matches_f_linear_in_any_shape_with_bias_and_residual(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(9, 40, generator=gen).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for bias in (None, b):
        lin = Linear(w, bias, kernel="transposed")
        want = torch.nn.functional.linear(x, w, bias).float()
        torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lin(x.view(3, 3, 40)).float(), want.view(3, 3, 96), rtol=tol, atol=tol)
        r = torch.randn(9, 96, generator=gen).to(dtype)
        torch.testing.assert_close(lin.add_to(r, x).float(), (r.float() + want), rtol=tol, atol=tol * 4)

"""The engine bench's comparison runners: each on one kernel, and the host's choice left as it was."""

import torch

from dspark_core.bench.engine import _runner_with_kernel
from dspark_core.model.layers import kernels_supported, linear_kernels, set_kernel


def test_comparison_runners_take_one_kernel_and_leave_the_hosts_choice(smollm2):
    runner = smollm2.runner
    chosen = (smollm2.kernel.kernel, smollm2.kernel.multi_kernel)
    set_kernel(runner.device, runner.dtype, *chosen)          # as the target's load left it (other tests load too)
    for kernel in kernels_supported(runner.device, runner.dtype):
        other = _runner_with_kernel(smollm2, kernel)
        assert {(layer.qkv.kernel, layer.qkv.multi_kernel) for layer in other.layers} == {(kernel, kernel)}
        assert linear_kernels(runner.device, runner.dtype) == chosen      # later drafters follow the host's pick
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        logits = [r.forward(r.new_cache(1, 16), ids, logits="all").logits for r in (runner, other)]
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-3, atol=5e-3)   # 30 layers of rounding


def test_the_sides_run_in_a_rotated_order_and_every_run_is_paired(smollm2, monkeypatch):
    """Each prompt runs the engine, the engine on every other kernel and HF generate, in an order rotated
    from one run to the next, so no side always runs first or right after HF; the lists stay paired."""
    from dspark_core.bench import engine
    order = []
    real_generate, real_hf = engine.generate, engine._hf_generate

    def generate(runner, ids, params, *a, **kw):
        if params.max_new_tokens > 4:                              # timed runs, not the warm-up
            order.append("engine" if runner is smollm2.runner else "other")
        return real_generate(runner, ids, params, *a, **kw)

    def hf_generate(model, ids, max_new):
        if max_new > 4:
            order.append("hf")
        return real_hf(model, ids, max_new)
    monkeypatch.setattr(engine, "generate", generate)
    monkeypatch.setattr(engine, "_hf_generate", hf_generate)
    monkeypatch.setattr(engine, "matmul_floor", lambda runner: {"bound_tok_s": 1.0, "weights_mb": 1.0, "stream_gb_s": 1.0})
    cfg = engine.EngineBenchConfig(reps=2, max_new_tokens=6, prompts=2, vllm=False)
    res = engine._measure_dtype(smollm2, ["Say hi.", "Count to three."], cfg, "float32", lambda m: None)
    n_sides = 1 + len(res["kernel_tok_s"]) - 1 + 1
    runs = [order[i:i + n_sides] for i in range(0, len(order), n_sides)]
    assert len(runs) == 4 and all(sorted(r) == sorted(runs[0]) for r in runs)
    assert len({r.index("hf") for r in runs}) > 1 and len({r[0] for r in runs}) > 1
    assert res["runs"] == 4 and all(len(v) == 4 for v in res["kernel_tok_s"].values())
    assert len(res["hf_generate_tok_s"]) == 4 and res["greedy_equal_to_hf"] == 4

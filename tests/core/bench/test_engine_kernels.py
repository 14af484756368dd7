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

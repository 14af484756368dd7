"""The frozen target: layers, the batched runner (KV cache, O(1) rollback, taps), target preparation."""

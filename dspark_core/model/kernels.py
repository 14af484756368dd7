"""Kernel choices decided by measuring on this host, cached by its hardware fingerprint.

Whether prepacked oneDNN weights (:class:`~dspark_core.model.layers.Linear`) beat ``F.linear`` depends on
the CPU, the dtype and the torch build: on one AMX host prepacked fp32 decoding ran 2.2x faster, on another
0.84x as fast. So the choice is measured when a target is loaded, on the target's own weight shapes at
decoding batch sizes, interleaved, and kept in ``<cache>/packing-<key>.json`` so the next load on the same
kind of machine reads it in microseconds. The measurement streams through several layers' matrices per
pass, as decoding does: one matrix timed over and over sits in cache and can favour the other kernel. ``DSPARK_PACKED_LINEAR=1`` or ``0`` overrides the measurement.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_core.model.host import host_fingerprint
from dspark_core.model.layers import Linear, packing_supported, set_packing

# packing must be at least this much faster to be chosen: a tie keeps the plain kernel, which needs no
# second copy of the weights and no self-check
MIN_GAIN = 0.03
ROWS = (1, 4, 8)            # tokens per call: a decoding step, a verify block, a small batch


@dataclass(frozen=True)
class PackingChoice:
    """Whether to prepack on ``device``/``dtype``, and the measurement that decided it."""

    device: str
    dtype: str
    packed: bool
    ratio: float | None       # prepacked time / F.linear time (< 1: packing is faster); None when not measured
    source: str               # "measured", "cache", "env" or "unsupported"
    hardware: dict

    def to_dict(self) -> dict:
        return asdict(self)


def _key(hardware: dict) -> str:
    return hashlib.sha256(json.dumps(hardware, sort_keys=True).encode()).hexdigest()[:16]


def _pass(fns: list, xs: list[torch.Tensor]) -> float:
    """One pass over every matrix, as a decoding step makes it: each weight read once, in order."""
    t = time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.perf_counter() - t


def measure_packing(weights: list[torch.Tensor], reps: int = 5, passes: int = 2) -> float | None:
    """Prepacked ÷ ``F.linear`` time of passes over ``weights`` (each matrix once per pass, as a decoding
    step streams its weights from memory, not one matrix over and over from cache) at :data:`ROWS` tokens
    per call: the median over ``reps`` repetitions, the two kernels interleaved in alternating order. None
    where a weight does not pack."""
    packed = [Linear(w, pack=True) for w in weights]
    if any(p.packed is None for p in packed):
        return None
    plain = [lambda x, w=w: F.linear(x, w) for w in weights]
    ratios = []
    with torch.inference_mode():
        inputs = {r: [torch.randn(r, w.shape[1], dtype=w.dtype, device=w.device) for w in weights] for r in ROWS}
        for r in ROWS:                                                  # warm both paths
            _pass(packed, inputs[r])
            _pass(plain, inputs[r])
        for rep in range(reps):
            tp = tu = 0.0
            for r in ROWS:
                for _ in range(passes):
                    if rep % 2 == 0:
                        tp += _pass(packed, inputs[r])
                        tu += _pass(plain, inputs[r])
                    else:
                        tu += _pass(plain, inputs[r])
                        tp += _pass(packed, inputs[r])
            ratios.append(tp / tu)
    return statistics.median(ratios)


def choose_packing(weights: list[torch.Tensor], cache: Path | None = None, log=None) -> PackingChoice:
    """Decide whether :class:`~dspark_core.model.layers.Linear` prepacks weights of ``weights``' device
    and dtype in this process: ``DSPARK_PACKED_LINEAR`` if set, else a cached measurement for this hardware,
    else a new measurement (about a second), written to ``cache``. Later ``Linear`` objects follow it."""
    w0 = weights[0]
    device, dtype = w0.device, w0.dtype
    hardware = {**host_fingerprint(device), "dtype": str(dtype).replace("torch.", "")}
    hardware.pop("processor", None)
    base = dict(device=device.type, dtype=hardware["dtype"], hardware=hardware)
    env = os.environ.get("DSPARK_PACKED_LINEAR", "").strip().lower()
    if not packing_supported(device, dtype):
        choice = PackingChoice(packed=False, ratio=None, source="unsupported", **base)
    elif env:
        choice = PackingChoice(packed=env not in ("0", "false", "no", "off"), ratio=None, source="env", **base)
    else:
        path = Path(cache) / f"packing-{_key(hardware)}.json" if cache else None
        choice = None
        if path is not None and path.exists():
            try:
                d = json.loads(path.read_text())
                if d.get("hardware") == hardware:
                    choice = PackingChoice(**{**d, "source": "cache"})
            except (OSError, ValueError, TypeError):
                choice = None
        if choice is None:
            ratio = measure_packing(weights)
            packed = ratio is not None and ratio < 1 - MIN_GAIN
            choice = PackingChoice(packed=packed, ratio=ratio, source="measured", **base)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(choice.to_dict(), indent=2))
                tmp.replace(path)
            if log is not None:
                log(f"kernels: prepacked {hardware['dtype']} linears run at {ratio:.2f}x of F.linear here; "
                    f"{'packing' if packed else 'not packing'} (cached in {path})" if ratio is not None else
                    "kernels: packing unavailable here")
    set_packing(device, dtype, choice.packed)
    return choice

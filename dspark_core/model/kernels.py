"""Kernel choices decided by measuring on this host, cached by its hardware fingerprint.

Which matmul kernel runs the target's frozen weights fastest (:class:`~dspark_core.model.layers.Linear`:
``F.linear``, oneDNN-prepacked, or a contiguous transposed copy) depends on the CPU, the dtype and the
torch build: on one AMX host prepacked fp32 decoding ran 2.2x faster than ``F.linear``, on another 0.84x
as fast, where the transposed copy ran 1.1-1.2x faster; in bf16 the same host favours packing. So the
choice is measured when a target is loaded, on the target's own weight shapes at decoding batch sizes,
interleaved, and kept in ``<cache>/kernel-<key>.json`` so the next load on the same kind of machine reads
it in microseconds. The measurement streams through several layers' matrices per pass, as decoding does:
one matrix timed over and over sits in cache and can favour another kernel. ``DSPARK_LINEAR_KERNEL``
(or ``DSPARK_PACKED_LINEAR=1``/``0``) overrides the measurement.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark_core.model.host import host_fingerprint
from dspark_core.model.layers import KERNEL_NAMES, Linear, kernel_from_env, kernels_supported, set_kernel

# another kernel must be at least this much faster than F.linear to be chosen: a tie keeps the plain
# kernel, which needs no second copy of the weights and no self-check
MIN_GAIN = 0.03
# tokens per call, measured apart: a one-token decoding step, and a verify block or a small batch
BUCKETS = {"one": (1,), "many": (4, 8)}
# two kernels (one copy of the weights each) only where the second copy takes at most this share of RAM
TWO_COPIES_MAX_RAM = 0.10


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel :class:`~dspark_core.model.layers.Linear` runs on ``device``/``dtype``, and the
    measurement that decided it."""

    device: str
    dtype: str
    kernel: str               # one-row calls (a decoding step): "linear", "packed" or "transposed"
    multi_kernel: str         # calls of several rows (verify blocks, batches)
    # bucket ("one", "many") -> kernel -> its time ÷ F.linear's (< 1: faster); the measured ones
    ratios: dict = field(default_factory=dict)
    source: str = "measured"  # "measured", "cache", "env" or "unsupported"
    hardware: dict = field(default_factory=dict)

    @property
    def packed(self) -> bool:
        return "packed" in (self.kernel, self.multi_kernel)

    @property
    def name(self) -> str:
        one, many = KERNEL_NAMES[self.kernel], KERNEL_NAMES[self.multi_kernel]
        return one if one == many else f"{one} (1 row) + {many} (more rows)"

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


def measure_kernels(weights: list[torch.Tensor], kernels: tuple[str, ...] | None = None, rows: tuple[int, ...] = (1,),
                    reps: int = 5, passes: int = 2) -> dict[str, float]:
    """Each kernel's time ÷ ``F.linear``'s over passes through ``weights`` (each matrix once per pass, as a
    decoding step streams its weights from memory, not one matrix over and over from cache) at ``rows``
    tokens per call: the median over ``reps`` repetitions, the kernels interleaved in a rotating order.
    ``kernels``: those to compare (default: every one supported here); one that cannot run these weights
    (a pack that fails its self-check) is left out."""
    w0 = weights[0]
    kernels = kernels or kernels_supported(w0.device, w0.dtype)
    runs = {"linear": [Linear(w, kernel="linear") for w in weights]}
    for k in kernels:
        if k != "linear":
            lins = [Linear(w, kernel=k) for w in weights]
            if all(lin.kernel == k for lin in lins):
                runs[k] = lins
    names = list(runs)
    ratios: dict[str, list[float]] = {k: [] for k in names if k != "linear"}
    with torch.inference_mode():
        inputs = {r: [torch.randn(r, w.shape[1], dtype=w.dtype, device=w.device) for w in weights] for r in rows}
        for r in rows:                                                  # warm every path
            for k in names:
                _pass(runs[k], inputs[r])
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            spent = dict.fromkeys(names, 0.0)
            for r in rows:
                for _ in range(passes):
                    for k in order:
                        spent[k] += _pass(runs[k], inputs[r])
            for k in ratios:
                ratios[k].append(spent[k] / spent["linear"])
    return {k: round(statistics.median(v), 4) for k, v in ratios.items()}


def pick(ratios: dict[str, float]) -> str:
    """The kernel to run: the fastest measured, if it beats ``F.linear`` by :data:`MIN_GAIN`."""
    best = min(ratios, key=ratios.get, default=None)
    return best if best is not None and ratios[best] < 1 - MIN_GAIN else "linear"


def pick_pair(ratios: dict[str, dict[str, float]], two_copies: bool) -> tuple[str, str]:
    """The kernels for one-row calls and for calls of several rows, from each bucket's ratios: each
    bucket's own pick where ``two_copies`` is allowed; else one kernel for both, the one with the best
    mean of the two buckets' ratios (a one-token step weighs as much as a verify block)."""
    one, many = pick(ratios.get("one", {})), pick(ratios.get("many", {}))
    if one == many or two_copies:
        return one, many
    mean = {k: (ratios["one"][k] + ratios["many"][k]) / 2 for k in ratios["one"] if k in ratios["many"]}
    k = pick(mean)
    return k, k


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_cache(path: Path | None, hardware: dict) -> KernelChoice | None:
    if path is None or not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        ok = kernels_supported(torch.device(d["device"]), getattr(torch, d["dtype"]))
        if d.get("hardware") != hardware or d.get("kernel") not in ok or d.get("multi_kernel") not in ok:
            return None
        return KernelChoice(**{**d, "source": "cache"})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def choose_kernel(weights: list[torch.Tensor], cache: Path | None = None, log=None,
                  total_bytes: int | None = None) -> KernelChoice:
    """Decide which kernels :class:`~dspark_core.model.layers.Linear` runs weights of ``weights``' device
    and dtype with in this process (one for one-row calls, one for several rows): the environment's if
    set, else a cached measurement for this hardware, else a new measurement (a few seconds), written to
    ``cache``. Two different kernels keep two copies of every weight, so they are chosen only where the
    second copy of ``total_bytes`` (the whole target's weights) fits in :data:`TWO_COPIES_MAX_RAM` of this
    machine's memory. Later ``Linear`` objects follow the choice."""
    w0 = weights[0]
    device, dtype = w0.device, w0.dtype
    hardware = {**host_fingerprint(device), "dtype": str(dtype).replace("torch.", "")}
    hardware.pop("processor", None)
    base = dict(device=device.type, dtype=hardware["dtype"], hardware=hardware)
    supported = kernels_supported(device, dtype)
    env = kernel_from_env()
    if len(supported) == 1:
        choice = KernelChoice(kernel="linear", multi_kernel="linear", source="unsupported", **base)
    elif env:
        k = env if env in supported else "linear"
        choice = KernelChoice(kernel=k, multi_kernel=k, source="env", **base)
    else:
        ram = _ram_bytes()
        two_copies = total_bytes is not None and ram is not None and total_bytes <= TWO_COPIES_MAX_RAM * ram
        hardware = {**hardware, "two_copies": two_copies}
        base["hardware"] = hardware
        path = Path(cache) / f"kernel-{_key(hardware)}.json" if cache else None
        choice = _read_cache(path, hardware)
        if choice is None:
            ratios = {b: measure_kernels(weights, supported, rows) for b, rows in BUCKETS.items()}
            one, many = pick_pair(ratios, two_copies)
            choice = KernelChoice(kernel=one, multi_kernel=many, ratios=ratios, source="measured", **base)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(choice.to_dict(), indent=2))
                tmp.replace(path)
            if log is not None:
                times = "; ".join(f"{b}: " + ", ".join(f"{KERNEL_NAMES[k]} {r:.2f}x" for k, r in rs.items())
                                  for b, rs in ratios.items())
                log(f"kernels: {hardware['dtype']} linears against F.linear here ({times}); running "
                    f"{choice.name} (cached in {path})")
    set_kernel(device, dtype, choice.kernel, choice.multi_kernel)
    return choice

"""SPS(B) profiling: engine steps per second for a verify batch of B tokens, draft cost included."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from dspark_core.engine.proposer import Proposer, propose_many
from dspark_core.model.host import host_fingerprint
from dspark_core.model.runner import TargetRunner
from dspark_core.engine.sampling import SamplingParams
from dspark_core.scheduling.policy import SPSTable


# what must match for a profile to describe this machine (torch and processor strings are informative only)
HARDWARE_KEYS = ("device", "dtype", "threads", "machine", "cpu", "isa", "gpu")


def hardware_fingerprint(runner: TargetRunner) -> dict:
    """:func:`host_fingerprint` of the runner's device, with the dtype it runs in."""
    info = host_fingerprint(runner.device)
    return {"device": info["device"], "dtype": str(runner.dtype).replace("torch.", ""), **info}


def hardware_mismatch(profiled: dict | None, here: dict) -> list[str]:
    """How the hardware a profile was measured on differs from ``here`` (``"field: theirs != ours"``); []
    when it matches. Fields a profile does not record (older profile files lack some) are not
    compared; the device is compared by type (``cuda:1`` matches ``cuda:0``)."""
    out = []
    for k in HARDWARE_KEYS:
        if not profiled or k not in profiled:
            continue
        a, b = profiled[k], here.get(k)
        if k == "device":
            a, b = str(a).split(":")[0], str(b).split(":")[0]
        if a != b:
            out.append(f"{k}: {profiled[k]!r} != {here.get(k)!r}")
    return out


def profile_sps(runner: TargetRunner, proposer: Proposer | None, max_tokens: int, reps: int = 5,
                context: int = 256, block: int = 7, log=None, rows: int | None = None) -> dict:
    """For B = 1..max_tokens: R requests with ``context`` cached tokens verify B tokens in one forward
    (lengths spread evenly; a row with more than its anchor first drafts a full block, as the engine
    does). Step time = drafting + verify; the median of ``reps`` runs gives SPS(B) = 1 / time; the table
    is made non-increasing. The two parts are also kept apart, medians per B: ``draft_seconds`` and
    ``forward_seconds`` (:class:`~dspark_core.scheduling.policy.StepCost` reads them).

    ``rows`` fixes R (the concurrency the table is for; B < R is impossible there and takes SPS(R));
    without it R = ceil(B / (block + 1)), the fewest rows that can hold B tokens."""
    if max_tokens < 1 or reps < 1:
        raise ValueError("max_tokens and reps must be >= 1")
    gen = torch.Generator().manual_seed(0)
    vocab = runner.arch.vocab_size
    taps = tuple(proposer.tap_layers) if proposer is not None else ()
    params = SamplingParams()
    raw: list[float] = []
    draft_s: list[float] = []
    fwd_s: list[float] = []
    cache, states, prompt, cur_R = None, [], None, 0
    for B in range(1, max_tokens + 1):
        if rows is not None and B < rows:
            continue
        R = rows or math.ceil(B / (block + 1))
        if R != cur_R:                      # a cache holding exactly R rows, as the engine would have
            cur_R = R
            cache = runner.new_cache(R, context + block + 2)
            prompt = torch.randint(0, vocab, (R, context), generator=gen)
            out = runner.forward(cache, prompt, taps=taps, logits="none")
            states = [proposer.start(prompt[i].tolist(), out.taps[i]) if proposer is not None else None
                      for i in range(R)]
        per = [B // R + (1 if i < B % R else 0) for i in range(R)]          # tokens per row, sum = B
        times, drafts, fwds = [], [], []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            if proposer is not None:                # drafting as the engine does it: one batched call
                propose_many(proposer, states, [int(t) for t in prompt[:, -1]], [block if n > 1 else 0 for n in per],
                             [params] * R, [None] * R)
            t1 = time.perf_counter()
            ids = torch.randint(0, vocab, (R, max(per)), generator=gen)
            runner.forward(cache, ids, logits="all", lengths=per, packed=True)
            t2 = time.perf_counter()
            for i in range(R):
                cache.truncate(i, context)
            if rep:                                                          # the first run warms up
                times.append(t2 - t0)
                drafts.append(t1 - t0 if proposer is not None else 0.0)
                fwds.append(t2 - t1)
        med = statistics.median(times)
        raw.append(1.0 / med)
        draft_s.append(statistics.median(drafts))
        fwd_s.append(statistics.median(fwds))
        if log:
            log(f"  B={B:3d} R={R}: {med * 1000:.2f} ms/step, {1 / med:.1f} steps/s")
    if rows is not None:
        pad = min(rows, max_tokens + 1) - 1
        raw, draft_s, fwd_s = [raw[0]] * pad + raw, [draft_s[0]] * pad + draft_s, [fwd_s[0]] * pad + fwd_s
    table = SPSTable.monotone(raw)
    return {"sps": list(table.sps), "measured": raw, "draft_seconds": draft_s, "forward_seconds": fwd_s,
            "max_tokens": max_tokens, "reps": reps, "rows": rows,
            "context": context, "block": block, "drafter": proposer.name if proposer is not None else "none",
            "hardware": hardware_fingerprint(runner),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save_sps(profile: dict, path: Path, plot: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2))
    if plot:
        import matplotlib               # imported here: slow to import and needed only for the plot
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.4))
        xs = range(1, len(profile["sps"]) + 1)
        ax.plot(xs, profile["measured"], ".", alpha=0.5, label="measured (median)")
        ax.plot(xs, profile["sps"], "-", label="SPS(B), monotone")
        ax.set_xlabel("verify batch B (tokens)")
        ax.set_ylabel("engine steps / s")
        ax.set_title(f"SPS(B) {profile['hardware']['device']} {profile['hardware']['dtype']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return path


def load_sps(path: Path) -> SPSTable:
    data = json.loads(Path(path).read_text())
    return SPSTable(tuple(data["sps"]))

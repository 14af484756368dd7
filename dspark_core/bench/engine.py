"""Benchmarks measured side by side in one run; results are medians and ratios, never single times."""

from __future__ import annotations

import statistics
import time

import torch

from dspark_core.engine.decode_one import generate
from dspark_core.engine.inputs import encode_prompt, resolve_dtype
from dspark_core.engine.sampling import SamplingParams

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
    import os

    from dspark_core.model.runner import TargetRunner
    from dspark_core.model.target import load_target
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


def engine_suite(args, settings, log=print) -> dict:
    """Plain engine vs HF ``generate`` and vs the engine without prepacked weights (``F.linear``): batch 1,
    greedy, same prompts, fp32 and bf16, interleaved reps."""
    from dspark_core.cli.common import load_target_from_args

    quick = bool(getattr(args, "quick", False))
    reps = args.reps or (2 if quick else 3)
    max_new = args.max_new_tokens or (48 if quick else 128)
    prompts = ENGINE_PROMPTS[:2] if quick else ENGINE_PROMPTS
    results: dict = {}
    for dtype_name in ("float32", "bfloat16"):
        args.dtype = dtype_name
        target = load_target_from_args(args, settings, keep_reference=True)
        hf = target.reference.to(target.runner.dtype)
        unpacked = _unpacked_runner(target)
        params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
        eng, ref, unp, equal, equal_unp = [], [], [], [], []
        encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
        for ids in encoded:                                   # warm-up, untimed
            generate(target.runner, ids, SamplingParams(max_new_tokens=4))
            generate(unpacked, ids, SamplingParams(max_new_tokens=4))
            _hf_generate(hf, ids, 4)
        for rep in range(reps):
            for i, ids in enumerate(encoded):
                t0 = time.perf_counter()
                res = generate(target.runner, ids, params)
                t_eng = time.perf_counter() - t0
                t0 = time.perf_counter()
                res_unp = generate(unpacked, ids, params)
                t_unp = time.perf_counter() - t0
                t0 = time.perf_counter()
                hf_ids = _hf_generate(hf, ids, max_new)
                t_hf = time.perf_counter() - t0
                eng.append(len(res.token_ids) / t_eng)
                unp.append(len(res_unp.token_ids) / t_unp)
                ref.append(len(hf_ids) / t_hf)
                equal.append(res.token_ids == hf_ids)
                equal_unp.append(res.token_ids == res_unp.token_ids)
                log(f"[engine/{dtype_name}] rep {rep + 1}/{reps} prompt {i + 1}/{len(encoded)}: "
                    f"engine {eng[-1]:.1f} tok/s, without packed weights {unp[-1]:.1f}, HF generate {ref[-1]:.1f}")
        ratios = [e / r for e, r in zip(eng, ref)]
        results[dtype_name] = {
            "engine_tok_s": [round(x, 2) for x in eng], "hf_generate_tok_s": [round(x, 2) for x in ref],
            "unpacked_engine_tok_s": [round(x, 2) for x in unp],
            "engine_median_tok_s": round(statistics.median(eng), 2),
            "hf_generate_median_tok_s": round(statistics.median(ref), 2),
            "unpacked_engine_median_tok_s": round(statistics.median(unp), 2),
            "ratio_median": round(statistics.median(ratios), 3),
            "packed_vs_unpacked_median": round(statistics.median(e / u for e, u in zip(eng, unp)), 3),
            "greedy_equal_to_hf": sum(equal), "greedy_equal_to_unpacked": sum(equal_unp), "runs": len(equal),
        }
        del target, hf, unpacked
    default = str(resolve_dtype("auto", str(args.device or "cpu"))).replace("torch.", "")   # what auto runs here
    return {
        "suite": "engine",
        "config": {"batch": 1, "greedy": True, "max_new_tokens": max_new, "prompts": len(prompts), "reps": reps,
                   "threads": torch.get_num_threads(), "torch": torch.__version__, "chat_template": True},
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


def demo(args, settings, log=print) -> int:
    """Prepare the target, then generate the same prompt plainly and with speculation, in fp32 (where
    speculative output is exactly the plain output) and in bf16 (faster on this CPU); print both tables."""
    from dspark_core.cli.common import load_target_from_args
    from dspark_core.drafters import build_proposer

    prompt = ("Write a Python function `word_count(text)` that returns a dict mapping each word to its count, "
              "then show an example call and its output.")
    trained = sorted((settings.home / "bench").glob("drafters-*/dspark-code/config.json"),
                     key=lambda p: p.stat().st_mtime)
    ckpt = trained[-1].parent if trained else None
    for i, dtype in enumerate(("float32", "bfloat16")):
        args.dtype = dtype
        target = load_target_from_args(args, settings)
        ids = encode_prompt(target.tokenizer, prompt, chat=True)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=target.stop_token_ids)
        log(f"target {target.name} ({target.fingerprint[:12]}), {dtype}, prompt of {len(ids)} tokens")
        generate(target.runner, ids, SamplingParams(max_new_tokens=4))       # warm-up
        base = generate(target.runner, ids, params)
        rows = [("none", base)]
        for kind in ("ngram", "dspark"):
            prop = build_proposer(kind, target.runner, target.fingerprint, ckpt if kind == "dspark" else None,
                                  block_size=4 if kind == "dspark" and ckpt else None)
            rows.append((kind if kind != "dspark" or not ckpt else "dspark (trained, code)",
                         generate(target.runner, ids, params, prop)))
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

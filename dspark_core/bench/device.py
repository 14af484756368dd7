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
   1, 8 and 32 rows; masked attention at new key lengths, with and without cuDNN's attention (which
   plans per shape: CUDA targets switch it off, see ``layers.keep_attention_off_cudnn``).
4. the serving path on the device: the continuous-batching engine under the live gate over the scheduled
   policy (per-concurrency SPS tables profiled there, the drafter plus prompt lookup), greedy output equal
   to plain decoding in fp32; in bf16, output tokens/s of that path ÷ no speculation at 1, 8 and 32
   concurrent requests (repetitions in alternating order, medians). With a random-weight target the
   drafter's proposals are useless, so this checks that the gate keeps speculation from costing throughput
   where it cannot pay, and what prompt lookup gives on the target's repetitive output.

Results are medians and ratios; nothing is asserted (tests do that on CPU)."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from dspark_core.bench.engine import ENGINE_PROMPTS, _hf_generate
from dspark_core.bench.inputs import Log, TargetLoader
from dspark_core.drafters import build_proposer
from dspark_core.engine.decode_one import generate
from dspark_core.engine.inputs import encode_prompt
from dspark_core.engine.plain_batch import BatchRequest, generate_batch
from dspark_core.engine.policy import LengthRule, PolicyDefaults
from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from dspark_core.scheduling import LiveGate, ScheduledPolicy, SPSTable, make_length_gate, make_policy
from dspark_core.scheduling.sps import hardware_fingerprint, profile_sps


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
    done = run_requests(runner, reqs, LengthRule("ragged", ragged), max_batch=4)
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


def _attention_new_shapes(device, calls: int = 24) -> dict:
    """Milliseconds per masked SDPA call at a key length not seen before (as a drafter's context grows)
    and at a repeated one, with this process's backend choice and with cuDNN's attention allowed: cuDNN
    plans per shape (tens of milliseconds per new length), which is why CUDA targets switch it off."""
    if torch.device(device).type != "cuda":
        return {}
    was = torch.backends.cuda.cudnn_sdp_enabled()

    def median_ms(grow: bool, base: int) -> float:
        ts = []
        for i in range(calls):
            n = base + (i if grow else 0)
            q = torch.randn(1, 9, 4, 64, device=device, dtype=torch.bfloat16)
            k = torch.randn(1, 9, n + 4, 64, device=device, dtype=torch.bfloat16)
            m = torch.ones(1, 1, 4, n + 4, dtype=torch.bool, device=device)
            _sync(device)
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=m)
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(ts[2:]), 3)

    out = {"cudnn_sdp_enabled": was, "new_length_ms": median_ms(True, 300), "same_length_ms": median_ms(False, 300)}
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        out["cudnn_new_length_ms"] = median_ms(True, 600)
        out["cudnn_same_length_ms"] = median_ms(False, 600)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    return out


class _NeverDraft(PolicyDefaults):
    """A policy under which no row drafts: the plain arm of the live gate, on its own."""

    def plan(self, keys, prev_survs):
        return [False] * len(keys)

    def __call__(self, survs, limits):
        return [0] * len(limits)


def _gate(target, prop, concurrency, block) -> object:
    tables = {c: SPSTable(tuple(profile_sps(target.runner, prop, c * (block + 1), reps=2, context=192, block=block,
                                            rows=c)["sps"])) for c in concurrency}
    return LiveGate(make_length_gate(ScheduledPolicy(tables, k=block)))


def _serving_requests(prompts, n, prop, max_new):
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=())
    return [SpecRequest(i, list(prompts[i % len(prompts)]), params, prop) for i in range(n)]


def _scheduled_lossless(target, prompts, max_new, log) -> dict:
    """fp32: the serving path (live gate over the scheduled policy, lookup + drafter) equals plain greedy."""
    runner = target.runner
    plain = [generate(runner, ids, SamplingParams(max_new_tokens=max_new, stop_token_ids=())).token_ids
             for ids in prompts]
    prop = build_proposer("dspark-lookup", runner, target.fingerprint, block_size=4)
    gate = _gate(target, prop, (4,), 4)
    done = run_requests(runner, _serving_requests(prompts, 8, prop, max_new), gate, max_batch=4)
    equal = sum(r.tokens == plain[r.key % len(prompts)] for r in done)
    out = {"requests": len(done), "rows": 4, "equal_plain": equal,
           "mismatches": _mismatches(runner, [prompts[r.key % len(prompts)] for r in done], "scheduled vs plain",
                                     ((i, plain[r.key % len(prompts)], r.tokens) for i, r in enumerate(done)))}
    log(f"[device] lossless fp32, live gate + scheduled policy, 4 rows: {equal}/{len(done)} equal plain")
    return out


def _scheduled_load(target, prompts, max_new, concurrency, reps, log) -> dict:
    """bf16: output tok/s of the serving path ÷ no speculation, per concurrency (3 waves of requests)."""
    runner, dev, block = target.runner, target.runner.device, 4
    plain_policy = make_policy("fixed", k=block)               # no proposer: every row decodes one token
    out: dict = {"max_new_tokens": max_new, "reps": reps, "block": block}
    for kind in ("dspark", "dspark-lookup"):
        prop = build_proposer(kind, runner, target.fingerprint, block_size=block)
        gate = _gate(target, prop, concurrency, block)
        run_requests(runner, _serving_requests(prompts, 2, prop, 8), gate, max_batch=2)     # warm-up
        rows = {}
        for c in concurrency:
            # "plain_arm": the proposer attached but no row ever drafts (the gate's plain arm alone): its
            # gap to "none" is what carrying a proposer costs a step, apart from anything the gate decides
            tok = {"none": [], "scheduled": [], "plain_arm": []}
            pols = {"none": (None, plain_policy), "scheduled": (prop, gate), "plain_arm": (prop, _NeverDraft())}
            for rep in range(reps):
                for pol in (tuple(tok) if rep % 2 == 0 else tuple(tok)[::-1]):
                    p, policy = pols[pol]
                    reqs = _serving_requests(prompts, 3 * c, p, max_new)
                    _sync(dev)
                    t0 = time.perf_counter()
                    done = run_requests(runner, reqs, policy, max_batch=c)
                    _sync(dev)
                    tok[pol].append(sum(len(r.tokens) for r in done) / (time.perf_counter() - t0))
            rows[str(c)] = {f"{k}_tok_s": round(statistics.median(v), 1) for k, v in tok.items()}
            rows[str(c)]["ratio"] = round(statistics.median(s / n for s, n in zip(tok["scheduled"], tok["none"])), 3)
            rows[str(c)]["plain_arm_ratio"] = round(statistics.median(s / n for s, n in zip(tok["plain_arm"],
                                                                                          tok["none"])), 3)
            rows[str(c)]["gate"] = gate.describe().get(str(gate.bucket(c)))
        out[kind] = rows
        log(f"[device] bf16 serving path, {kind}: scheduled ÷ none by concurrency "
            f"{ {c: r['ratio'] for c, r in rows.items()} }, plain arm alone ÷ none "
            f"{ {c: r['plain_arm_ratio'] for c, r in rows.items()} }; gate {gate.describe()}")
    return out


@dataclass(frozen=True)
class DeviceBenchConfig:
    device: str = "cuda"
    max_new_tokens: int = 96
    reps: int = 3                              # timing repetitions
    serving_max_new_tokens: int = 64           # the serving-path stage ...
    serving_concurrency: tuple[int, ...] = (1, 8, 32)
    serving_reps: int = 3

    @classmethod
    def quick(cls, device: str = "cuda") -> "DeviceBenchConfig":
        return cls(device=device, max_new_tokens=32, reps=1, serving_max_new_tokens=32, serving_concurrency=(1, 8),
                   serving_reps=1)


def _stage(result: dict, name: str, fn, log: Log) -> None:
    """Run one stage into ``result[name]``; a failure is reported with its traceback and the run goes on."""
    try:
        result[name] = fn()
    except Exception as exc:
        result["errors"][name] = f"{type(exc).__name__}: {exc} | " + traceback.format_exc()[-1500:]
        log(f"[device] {name} failed: {exc!r}")


def device_suite(load: TargetLoader, cfg: DeviceBenchConfig, log: Log = print) -> dict:
    t_start = time.perf_counter()
    if torch.device(cfg.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False       # float32 means float32 for the lossless checks
        torch.backends.cudnn.allow_tf32 = False
    max_new = cfg.max_new_tokens
    result: dict = {"suite": "device", "device": cfg.device, "errors": {}}
    target = load(dtype="float32", keep_reference=True)
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in ENGINE_PROMPTS]
    result["target"] = {"name": target.name, "fingerprint": target.fingerprint,
                        "layers": target.arch.num_layers, "hidden": target.arch.hidden_size,
                        "vocab": target.arch.vocab_size}
    _stage(result, "lossless_fp32", lambda: _lossless(target, prompts, max_new, log), log)
    _stage(result, "scheduled_lossless_fp32", lambda: _scheduled_lossless(target, prompts, max_new, log), log)
    del target
    target = load(dtype="bfloat16", keep_reference=True)
    result["hardware"] = hardware_fingerprint(target.runner)
    for name, fn in (
        ("timing_bf16", lambda: _timing(target, prompts, max_new, cfg.reps, 7, log)),
        ("sps_bf16", lambda: {
            "one_row": profile_sps(target.runner, None, 32, reps=5, context=256, rows=1)["sps"],
            "sixteen_rows": profile_sps(target.runner, None, 128, reps=5, context=256, rows=16)["sps"]}),
        ("throughput_bf16", lambda: _throughput(target, prompts, (1, 8, 32), max_new, log)),
        ("attention_shapes", lambda: _attention_new_shapes(cfg.device)),
        ("serving_bf16", lambda: _scheduled_load(target, prompts, cfg.serving_max_new_tokens, cfg.serving_concurrency,
                                                 cfg.serving_reps, log)),
    ):
        _stage(result, name, fn, log)
    if "sps_bf16" in result:
        one = result["sps_bf16"]["one_row"]
        result["sps_bf16"]["one_row"] = [round(x, 2) for x in one]
        result["sps_bf16"]["sixteen_rows"] = [round(x, 2) for x in result["sps_bf16"]["sixteen_rows"]]
        result["sps_bf16"]["ratio_B8_over_B1"] = round(one[7] / one[0], 3)
        result["sps_bf16"]["ratio_B32_over_B1"] = round(one[31] / one[0], 3)
    if torch.device(cfg.device).type == "cuda":
        result["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated(cfg.device) / 2**20, 1)
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
    at = result.get("attention_shapes")
    if at:
        lines.append(f"- masked attention, ms per call at a new / a repeated key length: {at['new_length_ms']} / "
                     f"{at['same_length_ms']} (cuDNN SDPA {'on' if at['cudnn_sdp_enabled'] else 'off'}); "
                     f"with cuDNN allowed {at['cudnn_new_length_ms']} / {at['cudnn_same_length_ms']}")
    sl = result.get("scheduled_lossless_fp32")
    if sl:
        lines.append(f"- lossless fp32, live gate + scheduled policy, {sl['rows']} rows: {sl['equal_plain']}/"
                     f"{sl['requests']} equal plain")
    sv = result.get("serving_bf16")
    if sv:
        for kind in ("dspark", "dspark-lookup"):
            if kind in sv:
                lines.append(f"- bf16 serving path ({kind}), scheduled ÷ none by concurrency: "
                             + ", ".join(f"c={c} {r['ratio']}x" for c, r in sv[kind].items()))
    if result.get("errors"):
        lines.append(f"- errors: {result['errors']}")
    return "\n".join(lines)


device_suite.render = render_markdown

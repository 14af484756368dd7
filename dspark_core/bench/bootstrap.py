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

SAMPLINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def bootstrap_suite(args, settings, log=print) -> dict:
    from dspark_core.bench.batch import package_revisions
    from dspark_core.data.prompts import DOMAINS, load_prompts
    from dspark_core.engine.inputs import encode_prompt

    quick = bool(args.quick)
    reps = args.reps or (1 if quick else 2)
    max_new = args.max_new_tokens or (24 if quick else 160)
    per_domain = 4 if quick else 16
    batches = (8,) if quick else (16, 32)
    against = getattr(args, "against", None)
    with package_revisions(against) as revisions:
        engines = {}
        for label, mod in revisions.items():
            target = mod("cli").load_target_from_args(args, settings)
            engines[label] = (target, mod("batch"), mod("sampling"), mod("engine"))
        tokenizer = engines["this"][0].tokenizer
        prompts = [encode_prompt(tokenizer, p.text, chat=True)
                   for d in DOMAINS for p in load_prompts(d, per_domain, 0)]
        log(f"[bootstrap] {len(prompts)} prompts ({per_domain} per domain), {max_new} new tokens, "
            f"batch {', '.join(map(str, batches))}, {reps} repetition(s)" + (f", against {against}" if against else ""))
        runs: dict = {}
        for rep in range(reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for label in order:
                target, batch_mod, sm, eng = engines[label]
                for name, sp in SAMPLINGS.items():
                    params = sm.SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(target.stop_token_ids), **sp)
                    for bs in batches:
                        dev = str(target.runner.device)
                        reqs = [batch_mod.BatchRequest(i, ids, params, eng.make_generator(1000 + i, dev))
                                for i, ids in enumerate(prompts)]
                        made = [0]
                        t0 = time.perf_counter()
                        batch_mod.generate_batch(target.runner, reqs, bs,
                                                 on_token=lambda n, made=made: made.__setitem__(0, made[0] + n))
                        wall = time.perf_counter() - t0
                        run = {"tok_s": made[0] / wall, "tokens": made[0]}
                        runs.setdefault(label, {}).setdefault(f"{name}@{bs}", []).append(run)
                        log(f"[bootstrap] rep {rep + 1}/{reps} {label:7s} {name:7s} batch {bs:2d}: "
                            f"{run['tok_s']:.1f} tok/s ({made[0]} tokens in {wall:.1f} s)")
    med = {label: {k: round(statistics.median(r["tok_s"] for r in v), 2) for k, v in by.items()}
           for label, by in runs.items()}
    this = runs["this"]
    paired = lambda a, b: round(statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(a, b)), 3)  # noqa: E731
    result = {"suite": "bootstrap", "quick": quick, "reps": reps, "max_new_tokens": max_new,
              "prompts": len(prompts), "batch_sizes": list(batches), "sampling": SAMPLINGS, "against": against,
              "tok_s": med,
              "runs": {label: {k: [{m: round(x, 2) for m, x in r.items()} for r in v] for k, v in by.items()}
                       for label, by in runs.items()},
              "ratios": {"sampled_vs_greedy": {str(bs): paired(this[f"sampled@{bs}"], this[f"greedy@{bs}"])
                                               for bs in batches}}}
    if len(batches) > 1:
        lo, hi = batches[0], batches[-1]
        result["ratios"][f"batch_{hi}_vs_{lo}"] = {name: paired(this[f"{name}@{hi}"], this[f"{name}@{lo}"])
                                                   for name in SAMPLINGS}
    if against:
        result["ratio_vs_against_paired"] = {k: paired(this[k], runs["against"][k]) for k in this}
    return result


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

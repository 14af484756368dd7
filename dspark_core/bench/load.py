"""``dspark bench --suite load``: throughput under concurrency for no speculation, fixed-block DSpark and
scheduled DSpark (STS-calibrated confidences + SPS(B)), measured in one run; ECE before/after STS.

The suite runs in three steps: calibrate the drafter per domain (:func:`_calibrate`), profile SPS(B) per
concurrency (:func:`_profile`), then run the same mixed-domain request stream under each policy and
concurrency (:func:`_run_policies`); :func:`_summary` turns the runs into medians and paired ratios.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_core.bench.inputs import Log
from dspark_core.calibration import STSConfig, crossfit_metrics, fit_sts
from dspark_core.data.bootstrap import heldout_records
from dspark_core.drafters import build_proposer
from dspark_core.engine.offset import RequestOffset
from dspark_core.engine.sampling import SamplingParams
from dspark_core.engine.spec_batch import SpecRequest, run_requests
from dspark_core.pipeline.steps import collect_rounds
from dspark_core.scheduling import LiveGate, ScheduledPolicy, SPSTable, StepCost, make_length_gate, make_policy
from dspark_core.scheduling.sps import profile_sps

CONCURRENCY = (1, 4, 8, 16)
POLICIES = ("none", "fixed", "scheduled")
RUN_ORDER = ("none", "scheduled", "fixed")   # the order runs take (reversed every other repetition)
WAVES = 6           # requests per concurrency level = WAVES x c (see _run_policies)
DOMAINS = ("chat", "code", "math")
BLOCK = 4           # drafts per round at most, for every policy


@dataclass(frozen=True)
class LoadBenchConfig:
    checkpoint: Path                           # the DSpark drafter (default: the drafters bench's generic one)
    concurrency: tuple[int, ...] = CONCURRENCY  # ascending
    policies: tuple[str, ...] = POLICIES       # always with "none", the baseline every ratio needs
    waves: int = WAVES
    reps: int = 4                              # interleaved repetitions per level
    max_new_tokens: int = 64
    calib_prompts: int = 24                    # held-out prompts per domain the calibration decodes ...
    calib_max_new_tokens: int = 192
    calib_seeds: tuple[int, ...] = (0, 1000)   # ... at T = 1 under each of these seeds (see _calibrate)
    min_rounds: int = 200                      # fewer fully verified rounds keep the identity calibration
    sps_reps: int = 2
    request_prior: float = 0.0                 # > 0: scheduled requests carry their own confidence offset, as
                                               # ``dspark serve --live-request-prior`` does; 0: none (its default)
    smoke: bool = False                        # `--quick`: the preset :meth:`quick`

    @classmethod
    def quick(cls, checkpoint: Path, concurrency: tuple[int, ...] = (1, 4),
              policies: tuple[str, ...] = POLICIES) -> "LoadBenchConfig":
        return cls(checkpoint=checkpoint, concurrency=concurrency, policies=policies, reps=1, max_new_tokens=32,
                   calib_prompts=3, calib_max_new_tokens=64, calib_seeds=(0,), min_rounds=50, sps_reps=1,
                   smoke=True)

    def requests(self, c: int) -> int:
        """Requests per run at concurrency ``c``: ``waves`` x c (at least 8; the smoke run: c, at least 2)."""
        return max(2, c) if self.smoke else max(8, self.waves * c)


def _ece_summary(cal, crossfit: list[dict] | None) -> dict:
    return {"raw": [m["ece"] for m in cal.raw], "calibrated": [m["ece"] for m in cal.calibrated],
            "floor": [m["ece_floor"] for m in cal.calibrated],
            # out of sample: each half of the prompts calibrated by STS fitted on the other half's rounds
            "crossfit": [m["ece"] for m in crossfit] if crossfit else None,
            "crossfit_floor": [m["ece_floor"] for m in crossfit] if crossfit else None,
            "auroc": [m["auroc"] for m in cal.raw], "temperatures": cal.temperatures,
            "rounds": cal.rounds, "fallback": cal.fallback}


def _calibrate(target, cfg: LoadBenchConfig, heldout: dict, log: Log) -> tuple[dict, dict]:
    """Step 1: STS per domain from fully verified held-out rounds; returns (ECE report, calibration the
    scheduled policy uses) per domain.

    ``ece[d]`` is the calibration at T = 1 (the sampled traffic the pipeline calibrates for; comparable
    across runs). The request stream is greedy, and a greedy round accepts more than a sampled one, so the
    survival a T = 1 calibration gives a greedy request is too low and the scheduler would lean to verifying
    too few drafts. The scheduled policy therefore uses a calibration fitted on greedy rounds of the same
    prompts, reported as ``ece[d]["stream"]``. At T = 1 every held-out prompt is decoded under each of
    ``calib_seeds``: a domain has few held-out prompts, and on few rounds the ECE even a perfectly calibrated
    predictor shows (sampling noise, ``floor``) sits near the 0.02 goal; more rounds lower that floor."""
    stream_temperature = 0.0
    seeds = {1.0: cfg.calib_seeds, stream_temperature: (0,)}
    ece, cals = {}, {}
    for d in DOMAINS:
        prop = build_proposer("dspark", target.runner, target.fingerprint, cfg.checkpoint)
        prompts = [list(r.prompt_ids) for r in heldout[d][:cfg.calib_prompts]]
        fitted, crossfit = {}, {}
        half = len(prompts) // 2
        for temp in (1.0, stream_temperature):
            # rounds per half of the prompts (prompt i is decoded with seed + i either way: the same rounds as
            # one call over all prompts), pooled for the fit, kept apart for the cross-fit
            halves = [[], []]
            for seed in seeds[temp]:
                for h, (lo, hi) in enumerate(((0, half), (half, len(prompts)))):
                    if hi > lo:
                        halves[h].append(collect_rounds(target.runner, prop, prompts[lo:hi], cfg.calib_max_new_tokens,
                                                        temp, target.stop_token_ids, seed=seed + lo))
            groups = [(torch.cat([c for c, _ in g]), torch.cat([a for _, a in g])) for g in halves if g]
            conf, acc = torch.cat([c for c, _ in groups]), torch.cat([a for _, a in groups])
            fitted[temp] = fit_sts(conf, acc, STSConfig(min_rounds=cfg.min_rounds, shift=True))
            with warnings.catch_warnings():              # a half below min_rounds keeps the identity: reported as is
                warnings.simplefilter("ignore", RuntimeWarning)
                crossfit[temp] = (crossfit_metrics(groups, STSConfig(min_rounds=cfg.min_rounds // 2, shift=True))
                                  if len(groups) == 2 else None)
        cals[d] = fitted[stream_temperature]
        ece[d] = {**_ece_summary(fitted[1.0], crossfit[1.0]),
                  "stream": {"temperature": stream_temperature,
                             **_ece_summary(fitted[stream_temperature], crossfit[stream_temperature])}}
        log(f"[load] {d}: STS at T = 1 on {ece[d]['rounds']} rounds, ECE {ece[d]['raw']} -> {ece[d]['calibrated']} "
            f"(cross-fit over prompt halves {ece[d]['crossfit']}); "
            f"greedy on {ece[d]['stream']['rounds']}: {ece[d]['stream']['raw']} -> {ece[d]['stream']['calibrated']}")
    return ece, cals


def _profile(target, prop, cfg: LoadBenchConfig, log: Log) -> tuple[dict, dict, dict]:
    """Step 2: SPS(B) with this drafter, one table per concurrency (drafting included for the rows that
    draft); returns the tables, the split step costs and the last profile."""
    tables, costs, prof = {}, {}, None
    for c in cfg.concurrency:
        prof = profile_sps(target.runner, prop, c * (BLOCK + 1), reps=cfg.sps_reps, context=192, block=BLOCK, rows=c)
        tables[c] = SPSTable(tuple(prof["sps"]))
        costs[c] = StepCost.from_profile(prof)
        log(f"[load] R={c}: SPS({c}) {tables[c](c):.1f}, SPS({c * (BLOCK + 1)}) {prof['sps'][-1]:.1f} steps/s; "
            f"forward {1000 * costs[c].forward_s(c):.1f} -> {1000 * costs[c].forward_s(c * (BLOCK + 1)):.1f} ms, "
            f"drafting 1 / {c} rows {1000 * costs[c].draft_s(1):.1f} / {1000 * costs[c].draft_s(c):.1f} ms")
    return tables, costs, prof


def _one_run(target, reqs: list, policy, c: int) -> dict:
    """One run of ``reqs`` at ``c`` rows under ``policy``: throughput, and where the time goes."""
    steps = [0, 0.0, 0, 0.0, 0]               # steps, seconds inside steps, tokens they made;
                                              # seconds and tokens of steps with fewer than c rows

    def on_step(rows, made, dt):
        steps[0] += 1
        steps[1] += dt
        steps[2] += made
        if rows < c:                          # the last wave draining (or a lone early row)
            steps[3] += dt
            steps[4] += made

    t0 = time.perf_counter()
    done = run_requests(target.runner, reqs, policy, max_batch=c, on_step=on_step)
    wall = time.perf_counter() - t0
    rounds = sum(r.stats.rounds for r in done)
    # inside steps (what a live gate measures) and outside them (joins with their prefill, departures): a
    # gate that ignores a cost its arm causes shows here
    return {"tok_s": sum(len(r.tokens) for r in done) / wall,
            "per_user": statistics.median(len(r.tokens) / (r.t_done - r.t_join) for r in done),
            "verified": sum(r.stats.verified for r in done) / rounds if rounds else 0.0,
            "steps": steps[0], "step_tok_s": steps[2] / steps[1] if steps[1] else 0.0,
            "outside_steps_share": 1.0 - steps[1] / wall,
            # steps with all c rows busy, and the share of time in steps with fewer: every request here makes
            # exactly max_new tokens, so without speculation a wave's rows finish together, while
            # speculating rows finish apart and leave the run's last steps part-full
            "full_step_tok_s": (steps[2] - steps[4]) / (steps[1] - steps[3]) if steps[1] > steps[3] else 0.0,
            "part_full_share": steps[3] / wall}


def _run_policies(target, prop, cfg: LoadBenchConfig, stream: list, cals: dict, gate: LiveGate,
                  log: Log) -> tuple[dict, dict]:
    """Step 3: the same mixed-domain request stream under each policy and concurrency, ``reps`` times,
    policies interleaved and in reverse order every other repetition (the shared machine drifts: a steady
    drift then favours no policy). The run order is none, scheduled, fixed (and back): the pair the >= 1.0
    goal compares runs back to back, so the host's drift over the longest (fixed) run stays out of their
    paired ratio. The scheduled policy has one live gate for the whole run, as a running server has: what
    it learned about a number of rows (a run's tail passes through every smaller one) carries over.

    ``waves`` x c requests per level. Every request makes exactly max_new tokens, so without speculation
    each wave's rows finish together, while speculating rows finish apart: the run ends with one request
    lifetime of part-full steps (the last requests draining) that only speculation has, a burst's end,
    not the steady state a server at concurrency c runs in; six waves give the steady part twice the
    weight three would. Returns the runs per policy and level, and the gate's state after each level."""
    runs = {p: {str(c): [] for c in cfg.concurrency} for p in cfg.policies}
    order = [p for p in RUN_ORDER if p in cfg.policies]
    gate_after = {}
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=())
    for c in cfg.concurrency:
        reqs_src = [stream[i % len(stream)] for i in range(cfg.requests(c))]
        for rep in range(cfg.reps):
            for pol in (order if rep % 2 == 0 else order[::-1]):
                shared = None if pol == "none" else prop      # one drafter serves every request (batched drafting)
                adapt = pol == "scheduled" and cfg.request_prior > 0
                reqs = [SpecRequest(i, ids, params, shared, calibrate=cals[d].apply if shared is not None else None,
                                    adapt=RequestOffset(cfg.request_prior) if adapt else None)
                        for i, (d, ids) in enumerate(reqs_src)]
                policy = gate if pol == "scheduled" else make_policy("fixed", k=BLOCK)
                run = _one_run(target, reqs, policy, c)
                runs[pol][str(c)].append(run)
                log(f"[load] c={c:2d} rep {rep + 1}/{cfg.reps} {pol:9s}: {run['tok_s']:.1f} tok/s total, "
                    f"{run['per_user']:.1f} tok/s per user, {run['verified']:.2f} drafts verified/round")
        gate_after[str(c)] = gate.describe()
    return runs, gate_after


def _summary(runs: dict, policies: tuple[str, ...]) -> dict:
    """Medians over repetitions, ratios of the medians to "none", and paired ratios (per repetition, each
    policy over the no-speculation run beside it; the median over repetitions)."""
    med = lambda p, c, k: round(statistics.median(r[k] for r in runs[p][c]), 2)  # noqa: E731
    throughput = {p: {c: med(p, c, "tok_s") for c in runs[p]} for p in policies}
    full = {p: {c: round(statistics.median([r["full_step_tok_s"] / n["full_step_tok_s"]
                                            for r, n in zip(runs[p][c], runs["none"][c]) if n["full_step_tok_s"]]
                                           or [0.0]), 3)
                for c in runs[p]} for p in policies}
    return {"throughput": throughput,
            "per_user_tok_s": {p: {c: med(p, c, "per_user") for c in runs[p]} for p in policies},
            "ratio_vs_none": {p: {c: round(throughput[p][c] / throughput["none"][c], 3) for c in throughput[p]}
                              for p in policies},
            "ratio_vs_none_paired": {p: {c: round(statistics.median(r["tok_s"] / n["tok_s"] for r, n in
                                                                    zip(runs[p][c], runs["none"][c])), 3)
                                         for c in runs[p]} for p in policies},
            "ratio_vs_none_first_rep": {p: {c: round(runs[p][c][0]["tok_s"] / runs["none"][c][0]["tok_s"], 3)
                                            for c in runs[p]} for p in policies},
            "full_step_ratio_vs_none_paired": full,
            "mean_verified_per_round": {p: {c: round(statistics.median(r["verified"] for r in runs[p][c]), 3)
                                            for c in runs[p]} for p in policies}}


def load_suite(target, cfg: LoadBenchConfig, home: Path, log: Log = print) -> dict:
    heldout = {d: heldout_records(home, d, target.fingerprint) for d in DOMAINS}
    t_start = time.perf_counter()
    ece, cals = _calibrate(target, cfg, heldout, log)
    prop = build_proposer("dspark", target.runner, target.fingerprint, cfg.checkpoint, block_size=BLOCK)
    tables, costs, prof = _profile(target, prop, cfg, log)
    stream = [(d, list(r.prompt_ids)) for i in range(64) for d in DOMAINS if i < len(heldout[d])
              for r in [heldout[d][i]]]
    gate = LiveGate(make_length_gate(ScheduledPolicy(tables, k=BLOCK, costs=costs)))
    runs, gate_after = _run_policies(target, prop, cfg, stream, cals, gate, log)
    summary = _summary(runs, cfg.policies)
    return {"suite": "load", "quick": cfg.smoke, "checkpoint": str(cfg.checkpoint), "block": BLOCK,
            "max_new_tokens": cfg.max_new_tokens, "concurrency": list(cfg.concurrency),
            "policies": list(cfg.policies), "throughput": summary["throughput"],
            "per_user_tok_s": summary["per_user_tok_s"], "ratio_vs_none": summary["ratio_vs_none"],
            "ratio_vs_none_paired": summary["ratio_vs_none_paired"],
            "ratio_vs_none_first_rep": summary["ratio_vs_none_first_rep"],
            "full_step_ratio_vs_none_paired": summary["full_step_ratio_vs_none_paired"],
            "reps": cfg.reps, "waves": None if cfg.smoke else cfg.waves,
            "requests_per_run": {str(c): cfg.requests(c) for c in cfg.concurrency},
            "runs": {p: {c: [{k: round(v, 3) for k, v in r.items()} for r in rs] for c, rs in runs[p].items()}
                     for p in cfg.policies},
            "gate": gate_after,         # the gate's state after each concurrency's runs
            "mean_verified_per_round": summary["mean_verified_per_round"], "ece": ece,
            "sps": {str(c): list(t.sps) for c, t in tables.items()},
            "step_cost": {str(c): {"forward_ms": [round(1000 * t, 3) for t in k.forward],
                                   "draft_ms": [round(1000 * t, 3) for t in k.draft]} for c, k in costs.items()},
            "hardware": prof["hardware"],
            "wall_seconds": round(time.perf_counter() - t_start, 1)}


def render_markdown(result: dict) -> str:
    cs = [str(c) for c in result["concurrency"]]
    paired = result.get("ratio_vs_none_paired") or result["ratio_vs_none"]
    lines = ["| policy | " + " | ".join(f"c={c} tok/s (x none; paired)" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    pols = [p for p in POLICIES if p in result["throughput"]]
    for p in pols:
        lines.append(f"| {p} | " + " | ".join(f"{result['throughput'][p][c]:.1f} "
                                              f"({result['ratio_vs_none'][p][c]:.2f}x; {paired[p][c]:.2f}x)"
                                              for c in cs) + " |")
    full = result.get("full_step_ratio_vs_none_paired")
    if full:
        lines.append("")
        lines.append("Inside steps with all c rows busy (paired x none): " + "; ".join(
            f"{p} " + " / ".join(f"{full[p][c]:.2f}x" for c in cs) for p in pols if p != "none"))
    lines.append("")
    lines.append("| domain | rounds | ECE raw (per position) | ECE after STS (in-sample) | floor (calibrated, same sample) "
                 "| ECE cross-fit (other half's STS) |")
    lines.append("|---|---|---|---|---|---|")
    for d, e in result["ece"].items():
        for label, cal in (("T = 1", e), ("greedy (the scheduled policy's)", e.get("stream"))):
            if cal:
                floor = ", ".join(f"{x:.3f}" for x in cal.get("floor", [])) or "-"
                cross = ", ".join(f"{x:.3f}" for x in cal.get("crossfit") or []) or "-"
                lines.append(f"| {d}, {label} | {cal['rounds']} | {', '.join(f'{x:.3f}' for x in cal['raw'])} | "
                             f"{', '.join(f'{x:.3f}' for x in cal['calibrated'])} | {floor} | {cross} |")
    return "\n".join(lines) + "\n"

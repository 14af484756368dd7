"""``dspark bench --suite calibration-drift``: live calibration against a stale one when the traffic shifts.

One drafter (the drafters bench's code drafter by default) ships with a calibration fitted the way the
retrain flow fits it: STS (+ shift) on fully verified rounds of held-out code prompts at the serving
temperature (0.7). Two in-process servers run the same script one after the other, the live calibrator on
in one (``live``) and off in the other (``stale``: the shipped calibration throughout, still measured):

1. ``before``: code prompts at c = 1, the traffic the calibration was fitted on;
2. the shift, at c = 1, long enough for a few thousand fully verified rounds: by default
   (``shift="temperature"``) the same code prompts (others than the fit's) now sampled at 1.0; with
   ``shift="domain"`` chat prompts at 0.7 (another domain's traffic; the code drafter then drafts so
   poorly there that the scheduler runs plain steps most of the time, and those label nothing); its
   output tokens/s is the c = 1 throughput;
3. the shifted traffic at c = 8; its output tokens/s is the c = 8 throughput.

Both servers run the scheduled policy (``policy``; the tests use ``fixed``) from the SPS(B) tables the
serve bench profiles (cached), with ``shadow_fraction`` of the rounds verified whole (labels for the
calibrator; the same share in both arms).
Every ``block`` new labelled rounds the bench reads the calibrator's per-position ECE over the newest
``block`` rounds: the live ECE is prequential (each round judged by the calibration in use when it arrived,
fitted on earlier rounds only). ``ece_after_shift`` is the worst position's ECE over the last window of
the shifted traffic (up to ``final_window`` rounds, kept by the bench beyond the calibrator's own window),
with the floor a perfectly calibrated predictor shows on as many rounds; ``throughput_ratio`` is live over stale output tokens/s at c = 1 and c = 8. Greedy
equality does not apply (sampled traffic); losslessness is what the tests hold.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dspark_core.calibration import Calibration, STSConfig, ece_floor, fit_sts, prefix_labels
from dspark_core.data.bootstrap import heldout_records
from dspark_core.drafters import build_proposer
from dspark_core.engine.sampling import SamplingParams
from dspark_core.pipeline.steps import collect_rounds

from .drafters import LocalSource
from .engine import Event, GenRequest
from .server import build_server
from .settings import ServeSettings

ARMS = ("stale", "live")


@dataclass(frozen=True)
class DriftBenchConfig:
    before_requests: int = 8         # code requests at c = 1 before the shift
    after_c1_requests: int = 300     # shifted requests at c = 1 (the ECE curve)
    after_requests: int = 96         # shifted requests at c = 8, after those
    max_new_tokens: int = 64
    temperature: float = 0.7         # the serving temperature the shipped calibration is fitted at
    shift: str = "temperature"       # "temperature": code prompts at after_temperature; "domain": chat prompts
    after_temperature: float = 1.0   # the sampling temperature after a temperature shift
    shadow_fraction: float = 0.5     # rounds verified whole in both arms (the calibrator's labels)
    live_window: int = 2048
    live_refit_every: int = 128
    live_min_rounds: int = 200
    live_max_backoff: int = 8        # refits without news stretch the interval up to 8 x live_refit_every
    block: int = 256                 # labelled rounds per point of the ECE curve
    # labelled rounds after the shift that ece_after_shift is read on (the newest; kept by the bench, so
    # it may exceed the calibrator's window): the floor falls as 1/sqrt(rounds), 0.0245 at 2048, about
    # 0.012 at 8192, so a 2 % goal needs several thousand rounds to be readable at all
    final_window: int = 8192
    calibration_prompts: int = 12    # held-out code prompts the shipped calibration is fitted on
    policy: str = "scheduled"        # the serving policy of both arms ("fixed" labels every round)
    smoke: bool = False

    def __post_init__(self):
        if self.shift not in ("temperature", "domain"):
            raise ValueError(f"unknown shift {self.shift!r}: use 'temperature' or 'domain'")

    @classmethod
    def quick(cls) -> "DriftBenchConfig":
        return cls(before_requests=2, after_requests=16, after_c1_requests=8, max_new_tokens=24, live_window=256,
                   live_refit_every=32, live_min_rounds=24, block=32, final_window=128, calibration_prompts=3,
                   smoke=True)


def fit_shipped_calibration(target, checkpoint: Path, prompts: list[list[int]], cfg: DriftBenchConfig) -> Calibration:
    """The calibration the drafter ships with: the flow's STS (+ shift) fit on fully verified rounds of
    ``prompts`` at the serving temperature."""
    prop = build_proposer("dspark", target.runner, target.fingerprint, checkpoint)
    conf, acc = collect_rounds(target.runner, prop, prompts, 96, cfg.temperature, target.stop_token_ids)
    return fit_sts(conf, acc, STSConfig(min_rounds=min(100, max(10, len(acc) // 2)), shift=True))


def _drive(engine, domain: str, prompts: list[list[int]], n: int, c: int, params: SamplingParams, seed0: int,
           tick=None) -> dict:
    """``n`` requests, ``c`` in flight (closed loop), straight into the engine; output tokens/s over the phase.
    ``tick`` runs on this thread after each finished request."""
    slots, done_all, lock = threading.Semaphore(c), threading.Event(), threading.Lock()
    state = {"tokens": 0, "finished": 0, "errors": 0}

    def emit(ev: Event) -> None:
        with lock:
            state["tokens"] += len(ev.token_ids)
            if ev.final:
                state["finished"] += 1
                state["errors"] += ev.error is not None
                if state["finished"] == n:
                    done_all.set()
        if ev.final:
            slots.release()

    t0 = time.perf_counter()
    for i in range(n):
        slots.acquire()
        if tick is not None:
            tick()
        ids = prompts[i % len(prompts)]
        engine.submit(GenRequest(f"{domain}-{seed0 + i}", domain, list(ids), str(i), params, seed0 + i, emit))
    if not done_all.wait(3600):
        raise RuntimeError("the engine did not finish the phase's requests in an hour")
    wall = time.perf_counter() - t0
    if tick is not None:
        tick()
    return {"requests": n, "concurrency": c, "tokens": state["tokens"], "errors": state["errors"],
            "wall_seconds": round(wall, 2), "output_tok_s": round(state["tokens"] / wall, 2)}


def _worst(xs: list[float]) -> float | None:
    return round(max(xs), 5) if xs else None


def _newest(parts: list[tuple[torch.Tensor, ...]], n: int) -> tuple[torch.Tensor, ...] | None:
    """The newest ``n`` rounds of ``parts`` (consecutive (raw, accepted, predicted) chunks), or None."""
    if n <= 0 or not parts:
        return None
    return tuple(torch.cat([p[i] for p in parts])[-n:] for i in range(3))


def _arm(arm: str, target, drafters: Path, sps: Path | None, before: list[list[int]], after: list[list[int]],
         cfg: DriftBenchConfig, home: Path, log) -> dict:
    settings = ServeSettings(home=home, policy=cfg.policy, shadow_fraction=cfg.shadow_fraction, poll_interval=0,
                             domains=("code",), default_domain="code", max_batch=8, traces=False, sps_path=sps,
                             drafter_dir=drafters, live_calibration=arm == "live", live_window=cfg.live_window,
                             live_refit_every=cfg.live_refit_every, live_min_rounds=cfg.live_min_rounds,
                             live_max_backoff=cfg.live_max_backoff)
    source = LocalSource(drafters, target.runner, target.fingerprint)
    state = build_server(settings, target, source)
    live = state.manager.current("code").live
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)   # no stop: equal lengths
    shifted = replace(params, temperature=cfg.after_temperature) if cfg.shift == "temperature" else params
    curve: list[dict] = []
    mark = {"at": 0, "shift": None}
    kept = {"seen": 0, "parts": [], "rows": 0}      # every labelled round in order, past the window's length

    def collect() -> None:
        data, kept["seen"] = live.rows_since(kept["seen"])
        if data is not None:
            kept["parts"].append(data)
            kept["rows"] += int(data[0].shape[0])

    def tick() -> None:
        collect()
        seen = live.rounds_seen
        if seen - mark["at"] >= cfg.block:
            mark["at"] = seen
            e = live.window_ece(last=cfg.block)
            curve.append({"rounds": seen, "after_shift": None if mark["shift"] is None else seen - mark["shift"],
                          "version": live.version, "raw": _worst(e["raw"]), "shipped": _worst(e["shipped"]),
                          "live": _worst(e["live"]), "live_per_position": e["live"]})

    def phase(requests, n, c, p, seed0) -> dict:
        fit0 = live.fit_seconds
        out = _drive(state.engine, "code", requests, n, c, p, seed0, tick)
        # CPU time the live arm's refits took during the phase (they share the host's cores with decoding)
        out["fit_seconds"] = round(live.fit_seconds - fit0, 2)
        return out

    state.start()
    try:
        phases = {"before": phase(before, cfg.before_requests, 1, params, 0)}
        collect()
        mark["shift"] = mark["at"] = live.rounds_seen
        kept_at_shift = kept["rows"]
        phases["after_c1"] = phase(after, cfg.after_c1_requests, 1, shifted, 20_000)
        phases["after_c8"] = phase(after, cfg.after_requests, 8, shifted, 10_000)
        collect()
        after_rounds = live.rounds_seen - mark["shift"]
        data = _newest(kept["parts"], min(cfg.final_window, kept["rows"] - kept_at_shift))
        final = live.window_ece(data)
        floor = [round(ece_floor(data[2][:, k]), 5) for k in range(live.block)] if data is not None else []
        shipped_surv = live.shipped.survival(data[0]) if data is not None and live.shipped else None
        labels = prefix_labels(data[1], live.block) if data is not None else None
        acceptance = (float(labels.mean(0)[0]) if labels is not None else None)
        desc = live.describe()
    finally:
        state.stop()
    log(f"[calibration-drift] {arm}: c=8 {phases['after_c8']['output_tok_s']} tok/s, c=1 "
        f"{phases['after_c1']['output_tok_s']} tok/s after the shift; worst-position ECE over the last "
        f"{final['rounds']} labelled rounds: live {_worst(final['live'])}, shipped {_worst(final['shipped'])} "
        f"(floor {_worst(floor)}); {desc['refits']} refits, refusals {desc['refusals']}")
    return {"phases": phases, "curve": curve, "rounds_after_shift": after_rounds,
            "final": {"rounds": final["rounds"], "raw": final["raw"], "shipped": final["shipped"], "live": final["live"],
                      "floor": floor, "first_position_acceptance": acceptance,
                      "shipped_mean_prediction": [round(float(x), 4) for x in shipped_surv.mean(0)]
                      if shipped_surv is not None else None},
            "refits": desc["refits"], "refusals": desc["refusals"], "version": desc["version"],
            "fit_seconds": desc["fit_seconds"], "refit_interval": desc["refit_interval"],
            "drift_refits": desc["drift_refits"],
            "temperatures": desc["temperatures"], "shifts": desc["shifts"]}


def calibration_drift(target, checkpoint: Path, shipped: Calibration, sps: Path | None, before: list[list[int]],
                      after: list[list[int]], cfg: DriftBenchConfig, home: Path, log=print) -> dict:
    """Both arms on the same script (module docstring); plain data."""
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="dspark-drift-"))
    try:
        folder = work / "drafters" / "code"
        folder.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            (folder / f).symlink_to((Path(checkpoint) / f).resolve())
        (folder / "calibration.json").write_text(json.dumps(shipped.to_dict()))
        arms = {arm: _arm(arm, target, work / "drafters", sps, before, after, cfg, work / arm, log) for arm in ARMS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = {str(c): round(arms["live"]["phases"][f"after_c{c}"]["output_tok_s"]
                           / max(arms["stale"]["phases"][f"after_c{c}"]["output_tok_s"], 1e-9), 3) for c in (1, 8)}
    return {"suite": "calibration-drift", "quick": cfg.smoke, "config": asdict(cfg), "checkpoint": str(checkpoint),
            "shipped": {"temperatures": shipped.temperatures, "shifts": shipped.shifts, "rounds": shipped.rounds},
            "ece_after_shift": {"live": _worst(arms["live"]["final"]["live"]),
                                "stale": _worst(arms["stale"]["final"]["live"]),
                                "floor": _worst(arms["live"]["final"]["floor"]),
                                "rounds": arms["live"]["final"]["rounds"]},
            "throughput_ratio": ratio, "arms": arms, "goals": {"ece_after_shift_live": 0.02, "throughput_ratio": 1.0},
            "wall_seconds": round(time.perf_counter() - t0, 1)}


def _prompts(home: Path, domain: str, fingerprint: str, kit) -> list[list[int]]:
    got = [list(r.prompt_ids) for r in heldout_records(home, domain, fingerprint)]
    if not got:
        raise kit.error(f"no held-out {domain} prompts", f"run: dspark traces bootstrap --domains {domain}")
    return got


def run(args, settings, kit) -> dict:
    """The ``calibration-drift`` bench suite (entry point ``dspark.bench_suites``)."""
    from .bench import ServeBenchConfig, _find_code_drafter, _prepare
    ckpt = Path(args.checkpoint) if args.checkpoint else _find_code_drafter(settings.home)
    if ckpt is None:
        raise kit.error("no trained code drafter", "pass --checkpoint or run dspark bench --suite drafters first")
    cfg = DriftBenchConfig.quick() if args.quick else DriftBenchConfig()
    if args.max_new_tokens:
        cfg = replace(cfg, max_new_tokens=args.max_new_tokens)
    target = kit.load_target(args, settings)
    code = _prompts(settings.home, "code", target.fingerprint, kit)
    if cfg.shift == "domain":
        after = _prompts(settings.home, "chat", target.fingerprint, kit)
    else:                                       # code prompts the shipped calibration was not fitted on
        after = code[cfg.calibration_prompts:] or code
    # the SPS(B) tables of the serve bench (profiled once per drafter, dtype and host, cached)
    serve_cfg = replace(ServeBenchConfig.from_args(args, settings.home, ckpt), block_size=None)
    _, sps = _prepare(serve_cfg, lambda: target, code, kit)
    key = hashlib.sha1(json.dumps([target.fingerprint, str(ckpt.resolve()), (ckpt / "model.safetensors").stat().st_mtime,
                                   str(target.runner.dtype), cfg.temperature, cfg.calibration_prompts]).encode()).hexdigest()[:12]
    cal_path = settings.home / "bench" / f"drift-{key}" / "calibration.json"
    if cal_path.exists():
        shipped = Calibration.from_dict(json.loads(cal_path.read_text()))
    else:
        shipped = fit_shipped_calibration(target, ckpt, code[:cfg.calibration_prompts], cfg)
        cal_path.parent.mkdir(parents=True, exist_ok=True)
        cal_path.write_text(json.dumps(shipped.to_dict()))
    kit.log(f"[calibration-drift] shipped calibration: {shipped.rounds} code rounds at T = {cfg.temperature}, "
            f"temperatures {shipped.temperatures}, shifts {shipped.shifts}")
    return calibration_drift(target, ckpt, shipped, sps, code, after, cfg, settings.home, kit.log)


def render_markdown(result: dict) -> str:
    e, r = result["ece_after_shift"], result["throughput_ratio"]
    lines = ["| | stale (shipped calibration) | live calibrator | live / stale |", "|---|---|---|---|",
             f"| worst-position ECE, last {e['rounds']} labelled rounds after the shift (floor {e['floor']}) | "
             f"{e['stale']} | {e['live']} | |"]
    for c in ("8", "1"):
        s, lv = (result["arms"][a]["phases"][f"after_c{c}"]["output_tok_s"] for a in ARMS)
        lines.append(f"| output tok/s after the shift, c = {c} | {s} | {lv} | {r[c]:.2f}x |")
    s, lv = (result["arms"][a]["phases"]["before"]["output_tok_s"] for a in ARMS)
    lines.append(f"| output tok/s before the shift, c = 1 (the traffic the shipped calibration was fitted on) | "
                 f"{s} | {lv} | {lv / max(s, 1e-9):.2f}x |")
    live = result["arms"]["live"]
    ph = live["phases"]
    if all("fit_seconds" in ph[k] for k in ("before", "after_c1", "after_c8")):
        lines.append("| live refits' CPU time, share of the phase's wall time: before / after c = 1 / after c = 8 | "
                     "| " + " / ".join(f"{ph[k]['fit_seconds']:.1f} s ({ph[k]['fit_seconds'] / max(ph[k]['wall_seconds'], 1e-9):.1%})"
                                       for k in ("before", "after_c1", "after_c8")) + " | |")
    interval = (f"; {live.get('drift_refits', 0)} refits started by the drift watch; refit interval now "
                f"{live['refit_interval']} rounds" if "refit_interval" in live else "")
    lines += ["", f"Live calibrator: {live['refits']} refits accepted, refusals {live['refusals'] or 'none'}; "
              f"temperatures now {live['temperatures']}, shifts {live['shifts']}{interval}."]
    curve = [p for p in live["curve"] if p["after_shift"] is not None]
    stale_curve = [p for p in result["arms"]["stale"]["curve"] if p["after_shift"] is not None]
    if curve:
        lines += ["", "Worst-position ECE over each block of labelled rounds after the shift (prequential; block i of "
                  "each arm):", "", "| block | rounds after the shift (live) | live | stale |", "|---|---|---|---|"]
        for i, p in enumerate(curve):
            s = stale_curve[i]["live"] if i < len(stale_curve) else "-"
            lines.append(f"| {i + 1} | {p['after_shift']} | {p['live']} | {s} |")
    return "\n".join(lines) + "\n"


run.render = render_markdown

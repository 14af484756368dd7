"""``dspark bench --suite calibration-drift``: live calibration against a stale one when the traffic shifts.

One drafter (the drafters bench's code drafter by default) ships with a calibration fitted the way the
retrain flow fits it: STS (+ shift) on fully verified rounds of held-out code prompts at the serving
temperature (0.7). Two in-process servers run the same script, the live calibrator on in one (``live``) and
off in the other (``stale``: the shipped calibration throughout, still measured). They take turns in chunks
of requests (``chunk_c1`` / ``chunk_c8``; the same requests and seeds on both, the first arm of each pair
alternating), so both see the shared host at the same minutes: run one after the other, the two arms read
0.83x to 1.11x apart on identical calibrations before the shift. A chunk of the live arm lasts until the
refit it set off has finished, so the arm pays for its own fits. The script:

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
with the floor a perfectly calibrated predictor shows on as many rounds and, per arm, the 5-95 % spread of
that figure over a block bootstrap of the window's rounds (``live_spread``, ``stale_spread``: rounds of one
request share its acceptance, so one run's ECE moves more than the floor says); ``throughput_ratio`` is live over stale output tokens/s at c = 1 and c = 8. Greedy
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

from dspark_core.calibration import (Calibration, STSConfig, ece_floor, fit_sts, paired_worst_ece_difference,
                                     position_ece, prefix_labels, worst_ece_spread)
from dspark_core.data.bootstrap import heldout_records
from dspark_core.drafters import build_proposer
from dspark_core.engine.sampling import SamplingParams
from dspark_core.pipeline.steps import collect_rounds

from .calibrator import LiveCalibrationSettings, replay
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
    chunk_c1: int = 20               # requests per chunk at c = 1: the arms alternate chunk by chunk
    chunk_c8: int = 16               # ... at c = 8
    block: int = 256                 # labelled rounds per point of the ECE curve
    # labelled rounds after the shift that ece_after_shift is read on (the newest; kept by the bench, so
    # it may exceed the calibrator's window): the floor falls as 1/sqrt(rounds), 0.0245 at 2048, about
    # 0.012 at 8192, so a 2 % goal needs several thousand rounds to be readable at all
    final_window: int = 8192
    # rounds per block of the bootstrap that puts a 90 % spread on ece_after_shift (longer than a request's
    # labelled rounds, so each resample keeps their dependence: calibration.worst_ece_spread)
    spread_block: int = 128
    calibration_prompts: int = 12    # held-out code prompts the shipped calibration is fitted on
    policy: str = "scheduled"        # the serving policy of both arms ("fixed" labels every round)
    smoke: bool = False

    def __post_init__(self):
        if self.shift not in ("temperature", "domain"):
            raise ValueError(f"unknown shift {self.shift!r}: use 'temperature' or 'domain'")

    @classmethod
    def quick(cls) -> "DriftBenchConfig":
        return cls(before_requests=2, after_requests=16, after_c1_requests=8, max_new_tokens=24, live_window=256,
                   live_refit_every=32, live_min_rounds=24, block=32, final_window=128, spread_block=16,
                   calibration_prompts=3,
                   chunk_c1=4, chunk_c8=8, smoke=True)


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


class _Arm:
    """One in-process server of the bench (``live``: its live calibrator on; ``stale``: off) and what the
    bench reads from it: the ECE curve, every labelled round after the shift, tokens and wall per phase."""

    def __init__(self, arm: str, target, drafters: Path, sps: Path | None, cfg: DriftBenchConfig, home: Path):
        settings = ServeSettings(home=home, policy=cfg.policy, shadow_fraction=cfg.shadow_fraction, poll_interval=0,
                                 domains=("code",), default_domain="code", max_batch=8, traces=False, sps_path=sps,
                                 drafter_dir=drafters, live_calibration=arm == "live", live_window=cfg.live_window,
                                 live_refit_every=cfg.live_refit_every, live_min_rounds=cfg.live_min_rounds,
                                 live_max_backoff=cfg.live_max_backoff)
        self.name, self.cfg = arm, cfg
        self.state = build_server(settings, target, LocalSource(drafters, target.runner, target.fingerprint))
        self.live = self.state.manager.current("code").live
        self.curve: list[dict] = []
        self.mark = {"at": 0, "shift": None}
        self.kept = {"seen": 0, "parts": [], "rows": 0}  # every labelled round in order, past the window's length
        self.phases: dict[str, dict] = {}
        self._fit: dict[str, float] = {}           # refit CPU seconds per phase, unrounded

    def collect(self) -> None:
        data, self.kept["seen"] = self.live.rows_since(self.kept["seen"])
        if data is not None:
            self.kept["parts"].append(data)
            self.kept["rows"] += int(data[0].shape[0])

    def tick(self) -> None:
        self.collect()
        seen = self.live.rounds_seen
        if seen - self.mark["at"] >= self.cfg.block:
            self.mark["at"] = seen
            e = self.live.window_ece(last=self.cfg.block)
            self.curve.append({"rounds": seen, "after_shift": None if self.mark["shift"] is None else seen - self.mark["shift"],
                               "version": self.live.version, "raw": _worst(e["raw"]), "shipped": _worst(e["shipped"]),
                               "live": _worst(e["live"]), "live_per_position": e["live"]})

    def shift(self) -> None:
        self.collect()
        self.mark["shift"] = self.mark["at"] = self.live.rounds_seen
        self.kept_at_shift = self.kept["rows"]

    def chunk(self, phase: str, requests, n: int, c: int, params: SamplingParams, seed0: int) -> float:
        """``n`` requests of ``phase``; its wall time runs until a refit the chunk set off has finished too
        (the live arm pays for its fits, never the arm that runs next). Returns its output tokens/s."""
        fit0 = self.live.fit_seconds
        t0 = time.perf_counter()
        out = _drive(self.state.engine, "code", requests, n, c, params, seed0, self.tick)
        while self.live.describe()["fitting"]:
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        ph = self.phases.setdefault(phase, {"requests": 0, "concurrency": c, "tokens": 0, "errors": 0,
                                            "wall_seconds": 0.0, "fit_seconds": 0.0, "chunks": []})
        ph["requests"] += n
        ph["tokens"] += out["tokens"]
        ph["errors"] += out["errors"]
        ph["wall_seconds"] = round(ph["wall_seconds"] + wall, 2)
        # CPU time the live arm's refits took (they share the host's cores with decoding)
        # (summed unrounded: rounding each chunk's share would drift over a phase's many chunks)
        self._fit[phase] = self._fit.get(phase, 0.0) + self.live.fit_seconds - fit0
        ph["fit_seconds"] = round(self._fit[phase], 2)
        ph["output_tok_s"] = round(ph["tokens"] / max(ph["wall_seconds"], 1e-9), 2)
        tok_s = out["tokens"] / max(wall, 1e-9)
        ph["chunks"].append(round(tok_s, 2))
        return tok_s

    def rounds(self) -> dict:
        """Every labelled round this arm saw, in arrival order (raw confidence logits [N, G], accepted [N]),
        and how many came before the shift: what :func:`replay_suite` replays."""
        self.collect()
        conf, acc = (torch.cat([p[i] for p in self.kept["parts"]]) if self.kept["parts"] else torch.zeros(0)
                     for i in range(2))
        return {"conf": conf, "accepted": acc, "shift_at": self.kept_at_shift}

    def result(self, log) -> dict:
        self.collect()
        live, cfg = self.live, self.cfg
        after_rounds = live.rounds_seen - self.mark["shift"]
        data = _newest(self.kept["parts"], min(cfg.final_window, self.kept["rows"] - self.kept_at_shift))
        final = live.window_ece(data)
        floor = [round(ece_floor(data[2][:, k]), 5) for k in range(live.block)] if data is not None else []
        labels = prefix_labels(data[1], live.block) if data is not None else None
        spread = worst_ece_spread(data[2], labels, block=cfg.spread_block) if data is not None else None
        shipped_surv = live.shipped.survival(data[0]) if data is not None and live.shipped else None
        acceptance = (float(labels.mean(0)[0]) if labels is not None else None)
        desc = live.describe()
        ph = self.phases
        log(f"[calibration-drift] {self.name}: c=8 {ph['after_c8']['output_tok_s']} tok/s, c=1 "
            f"{ph['after_c1']['output_tok_s']} tok/s after the shift; worst-position ECE over the last "
            f"{final['rounds']} labelled rounds: live {_worst(final['live'])}, shipped {_worst(final['shipped'])} "
            f"(floor {_worst(floor)}); {desc['refits']} refits, refusals {desc['refusals']}")
        return {"phases": ph, "curve": self.curve, "rounds_after_shift": after_rounds,
                "final": {"rounds": final["rounds"], "raw": final["raw"], "shipped": final["shipped"],
                          "live": final["live"], "floor": floor, "live_worst_spread": spread,
                          "first_position_acceptance": acceptance,
                          "shipped_mean_prediction": [round(float(x), 4) for x in shipped_surv.mean(0)]
                          if shipped_surv is not None else None},
                "refits": desc["refits"], "refusals": desc["refusals"], "version": desc["version"],
                "fit_seconds": desc["fit_seconds"], "refit_interval": desc["refit_interval"],
                "drift_refits": desc["drift_refits"], "temperatures": desc["temperatures"], "shifts": desc["shifts"]}


def _interleaved(arms: dict[str, _Arm], phase: str, requests, n: int, c: int, params: SamplingParams, seed0: int,
                 chunk: int) -> list[float]:
    """``n`` requests of ``phase`` on every arm, in chunks of ``chunk`` requests that alternate between the
    arms (the first arm of a pair alternates too), each chunk the same requests and seeds on both arms:
    the arms see the host at the same minutes, so its drift cancels from their ratio. Returns live ÷ stale
    tokens/s of each pair of chunks."""
    ratios = []
    order = list(arms)
    for i, at in enumerate(range(0, n, chunk)):
        m = min(chunk, n - at)
        got = {}
        for name in (order if i % 2 == 0 else order[::-1]):
            got[name] = arms[name].chunk(phase, requests[at % len(requests):] + requests[:at % len(requests)], m, c,
                                         params, seed0 + at)
        ratios.append(got["live"] / max(got["stale"], 1e-9))
    return ratios


def calibration_drift(target, checkpoint: Path, shipped: Calibration, sps: Path | None, before: list[list[int]],
                      after: list[list[int]], cfg: DriftBenchConfig, home: Path, log=print,
                      rounds_dir: Path | None = None) -> dict:
    """Both arms on the same script (module docstring), interleaved chunk by chunk; plain data. With
    ``rounds_dir``, each arm's labelled rounds are saved there (``rounds-<arm>.pt``) for
    ``dspark bench --suite calibration-replay``."""
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="dspark-drift-"))
    arms: dict[str, _Arm] = {}
    try:
        folder = work / "drafters" / "code"
        folder.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            (folder / f).symlink_to((Path(checkpoint) / f).resolve())
        (folder / "calibration.json").write_text(json.dumps(shipped.to_dict()))
        params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)  # no stop: equal lengths
        shifted = replace(params, temperature=cfg.after_temperature) if cfg.shift == "temperature" else params
        for arm in ARMS:
            arms[arm] = _Arm(arm, target, work / "drafters", sps, cfg, work / arm)
            arms[arm].state.start()
        paired = {"before": _interleaved(arms, "before", before, cfg.before_requests, 1, params, 0,
                                         max(1, cfg.before_requests // 2))}
        for a in arms.values():
            a.shift()
        paired["after_c1"] = _interleaved(arms, "after_c1", after, cfg.after_c1_requests, 1, shifted, 20_000,
                                          cfg.chunk_c1)
        paired["after_c8"] = _interleaved(arms, "after_c8", after, cfg.after_requests, 8, shifted, 10_000,
                                          cfg.chunk_c8)
        res = {name: a.result(log) for name, a in arms.items()}
        if rounds_dir is not None:
            rounds_dir.mkdir(parents=True, exist_ok=True)
            for name, a in arms.items():
                torch.save({**a.rounds(), "shipped": shipped.to_dict(), "config": asdict(cfg), "arm": name},
                           rounds_dir / f"rounds-{name}.pt")
            log(f"[calibration-drift] labelled rounds saved in {rounds_dir} (dspark bench --suite calibration-replay)")
    finally:
        for a in arms.values():
            a.state.stop()
        shutil.rmtree(work, ignore_errors=True)
    ratio = {str(c): round(res["live"]["phases"][f"after_c{c}"]["output_tok_s"]
                           / max(res["stale"]["phases"][f"after_c{c}"]["output_tok_s"], 1e-9), 3) for c in (1, 8)}
    median = {k: round(sorted(v)[len(v) // 2], 3) for k, v in paired.items() if v}
    return {"suite": "calibration-drift", "quick": cfg.smoke, "config": asdict(cfg), "checkpoint": str(checkpoint),
            "shipped": {"temperatures": shipped.temperatures, "shifts": shipped.shifts, "rounds": shipped.rounds},
            "ece_after_shift": {"live": _worst(res["live"]["final"]["live"]),
                                "stale": _worst(res["stale"]["final"]["live"]),
                                "floor": _worst(res["live"]["final"]["floor"]),
                                "live_spread": res["live"]["final"]["live_worst_spread"],
                                "stale_spread": res["stale"]["final"]["live_worst_spread"],
                                "rounds": res["live"]["final"]["rounds"]},
            "throughput_ratio": ratio, "throughput_ratio_paired_median": median,
            "arms": res, "goals": {"ece_after_shift_live": 0.02, "throughput_ratio": 1.0},
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
    cal_path = _drift_folder(settings.home, target, ckpt, cfg) / "calibration.json"
    if cal_path.exists():
        shipped = Calibration.from_dict(json.loads(cal_path.read_text()))
    else:
        shipped = fit_shipped_calibration(target, ckpt, code[:cfg.calibration_prompts], cfg)
        cal_path.parent.mkdir(parents=True, exist_ok=True)
        cal_path.write_text(json.dumps(shipped.to_dict()))
    kit.log(f"[calibration-drift] shipped calibration: {shipped.rounds} code rounds at T = {cfg.temperature}, "
            f"temperatures {shipped.temperatures}, shifts {shipped.shifts}")
    return calibration_drift(target, ckpt, shipped, sps, code, after, cfg, settings.home, kit.log,
                             rounds_dir=None if args.quick else cal_path.parent)


def _drift_folder(home: Path, target, ckpt: Path, cfg: DriftBenchConfig) -> Path:
    """Where the bench keeps what it derives from one drafter on one target: the shipped calibration it
    fitted and the labelled rounds of the last full run."""
    key = hashlib.sha1(json.dumps([target.fingerprint, str(ckpt.resolve()), (ckpt / "model.safetensors").stat().st_mtime,
                                   str(target.runner.dtype), cfg.temperature, cfg.calibration_prompts]).encode()).hexdigest()[:12]
    return home / "bench" / f"drift-{key}"


# ------------------------------------------------------------------------------------------- replay
REPLAY_WINDOWS = (1024, 2048, 4096, 8192)


def replay_rounds(rounds: dict, windows: tuple[int, ...] = REPLAY_WINDOWS, base: LiveCalibrationSettings | None = None,
                  final_window: int | None = None, spread_block: int = 128, log=print) -> dict:
    """One arm's recorded rounds (:meth:`_Arm.rounds`) replayed through the live calibrator at each window
    size (:func:`serving.calibrator.replay`; the rest of ``base``, by default the drift bench's settings): per
    window, the per-position prequential ECE over the last ``final_window`` rounds after the shift (as
    ``ece_after_shift`` reads it), its worst position, refits, and the worst-position ECE minus that of the
    recorded run's window with its 5-95 % range over block resamples of the same rounds."""
    cfg = DriftBenchConfig(**{k: v for k, v in rounds["config"].items() if k in DriftBenchConfig.__dataclass_fields__})
    base = base or LiveCalibrationSettings(window=cfg.live_window, refit_every=cfg.live_refit_every,
                                           min_rounds=cfg.live_min_rounds, max_backoff=cfg.live_max_backoff)
    conf, acc = rounds["conf"].float(), rounds["accepted"].long()
    shipped = Calibration.from_dict(rounds["shipped"])
    n_after = conf.shape[0] - int(rounds["shift_at"])
    last = min(final_window or cfg.final_window, n_after)
    labels = prefix_labels(acc[-last:], conf.shape[1])
    out, sized = {}, {}
    for w in dict.fromkeys((*windows, base.window)):
        t0 = time.perf_counter()
        surv, live = replay(conf, acc, shipped, replace(base, window=w))
        sized[w] = surv[-last:]
        per = position_ece(sized[w], labels)
        out[w] = {"window": w, "live": per, "worst": max(per), "refits": live.refits,
                  "refusals": dict(live.refusals), "seconds": round(time.perf_counter() - t0, 1)}
        log(f"[calibration-replay] {rounds.get('arm', '?')} rounds, window {w}: worst-position ECE {max(per):.4f} "
            f"({live.refits} refits, {out[w]['seconds']} s)")
    for w in out:
        out[w]["minus_recorded_window"] = paired_worst_ece_difference(sized[w], sized[base.window], labels,
                                                                      block=spread_block)
    return {"rounds": int(conf.shape[0]), "rounds_after_shift": n_after, "final_window": last,
            "recorded_window": base.window, "floor": _worst([ece_floor(sized[base.window][:, k])
                                                             for k in range(conf.shape[1])]),
            "shipped": _worst(position_ece(shipped.survival(conf[-last:]), labels)),
            "windows": [out[w] for w in sorted(out)]}


def replay_suite(args, settings, kit) -> dict:
    """The ``calibration-replay`` bench suite: the labelled rounds the last full ``calibration-drift`` run of
    this drafter saved, replayed through the live calibrator at several window sizes. Both arms' rounds are
    replayed: each is the same traffic, labelled under another calibration, so they are two samples."""
    from .bench import _find_code_drafter
    ckpt = Path(args.checkpoint) if args.checkpoint else _find_code_drafter(settings.home)
    if ckpt is None:
        raise kit.error("no trained code drafter", "pass --checkpoint (the drafter the drift bench ran)")
    target = kit.load_target(args, settings)
    folder = _drift_folder(settings.home, target, ckpt, DriftBenchConfig())
    files = {arm: folder / f"rounds-{arm}.pt" for arm in ARMS}
    if not all(f.exists() for f in files.values()):
        raise kit.error(f"no recorded rounds for {ckpt} in {folder}",
                        f"run dspark bench --suite calibration-drift --checkpoint {ckpt} first (a full run saves them)")
    t0 = time.perf_counter()
    windows = REPLAY_WINDOWS[:2] if args.quick else REPLAY_WINDOWS
    arms = {arm: replay_rounds(torch.load(f), windows, log=kit.log) for arm, f in files.items()}
    return {"suite": "calibration-replay", "quick": bool(args.quick), "checkpoint": str(ckpt),
            "windows": list(windows), "arms": arms, "wall_seconds": round(time.perf_counter() - t0, 1)}


def render_replay(result: dict) -> str:
    arms = result["arms"]
    lines = ["| live window | " + " | ".join(f"worst-position ECE, {a} run's rounds (− recorded window, 5-95 %)"
                                             for a in arms) + " | refits |",
             "|---|" + "---|" * len(arms) + "---|"]
    by = {a: {w["window"]: w for w in r["windows"]} for a, r in arms.items()}
    for w in sorted(next(iter(by.values()))):
        cells = []
        for a in arms:
            x = by[a][w]
            d = x["minus_recorded_window"]
            cells.append(f"{x['worst']:.4f} ({d['value']:+.4f}, {d['low']:+.4f} to {d['high']:+.4f})")
        lines.append(f"| {w} | " + " | ".join(cells) + " | " + " / ".join(str(by[a][w]['refits']) for a in arms) + " |")
    first = next(iter(arms.values()))
    lines += ["", f"Each arm's rounds: the last {first['final_window']} of {first['rounds_after_shift']} labelled "
              f"rounds after the shift (floor {first['floor']}; the shipped calibration reads {first['shipped']}); "
              f"recorded with a {first['recorded_window']}-round window."]
    return "\n".join(lines) + "\n"


replay_suite.render = render_replay


def _spread(s: list[float] | None) -> str:
    return f" (5-95 % over resamples: {s[0]}-{s[1]})" if s else ""


def render_markdown(result: dict) -> str:
    e, r = result["ece_after_shift"], result["throughput_ratio"]
    lines = ["| | stale (shipped calibration) | live calibrator | live / stale |", "|---|---|---|---|",
             f"| worst-position ECE, last {e['rounds']} labelled rounds after the shift (floor {e['floor']}) | "
             f"{e['stale']}{_spread(e.get('stale_spread'))} | {e['live']}{_spread(e.get('live_spread'))} | |"]
    med = result.get("throughput_ratio_paired_median", {})

    def paired(phase: str) -> str:
        n = len(result["arms"]["live"]["phases"][phase].get("chunks", []))
        return f" (median of {n} paired chunks {med[phase]:.2f}x)" if phase in med and n else ""

    for c in ("8", "1"):
        s, lv = (result["arms"][a]["phases"][f"after_c{c}"]["output_tok_s"] for a in ARMS)
        lines.append(f"| output tok/s after the shift, c = {c} | {s} | {lv} | {r[c]:.2f}x{paired(f'after_c{c}')} |")
    s, lv = (result["arms"][a]["phases"]["before"]["output_tok_s"] for a in ARMS)
    lines.append(f"| output tok/s before the shift, c = 1 (the traffic the shipped calibration was fitted on) | "
                 f"{s} | {lv} | {lv / max(s, 1e-9):.2f}x{paired('before')} |")
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

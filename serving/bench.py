"""``dspark bench --suite serve``: the real server over HTTP, no speculation vs DSpark, at concurrency
1, 4, 8 and 16 on held-out code prompts.

Each mode starts ``dspark serve`` in a subprocess (its own interpreter, so the load generator here does
not share a GIL with it) on a loopback port: ``--policy none`` for the baseline, ``--policy scheduled``
with the trained code drafter, its STS calibration (fitted here on held-out code rounds) and SPS(B)
tables profiled here per concurrency and de-spiked (cached under ``$DSPARK_HOME/bench``). Both servers run
side by side; each level is repeated (``--reps``, 3 by default) with the modes interleaved, and medians
over repetitions are reported. A level starts with an unmeasured warm-up wave at its concurrency (both
modes), then the client streams every request (SSE, ``ignore_eos``, greedy) and measures time to first token, inter-token latency (a chunk of n
tokens after t seconds counts n times t/n), per-user tokens/s (a request's tokens over its own wall time)
and total output tokens/s. Greedy outputs of the two modes are compared token for token (a lossless
check over HTTP; in bf16 a near-tie may flip, so mismatches are reported, not raised).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_core.calibration import STSConfig, fit_sts
from dspark_core.data.bootstrap import heldout_records
from dspark_core.drafters import build_proposer
from dspark_core.model.target import DEFAULT_TARGET, resolve_target_dir
from dspark_core.pipeline.steps import collect_rounds
from dspark_core.scheduling import LiveGate, SPSTable
from dspark_core.scheduling.sps import HARDWARE_KEYS, hardware_fingerprint, profile_sps

CONCURRENCY = (1, 4, 8, 16)
MODES = ("none", "dspark")
WAVES = 3           # requests per level = WAVES x c, at least 8 (three waves: long enough to measure)


@dataclass(frozen=True)
class ServeBenchConfig:
    """What the suite measures, from the ``dspark bench`` options (checked by the CLI)."""

    checkpoint: Path                # the trained code drafter
    home: Path                      # DSPARK_HOME, shared with the servers
    target: str                     # the servers' --target / --model / --dtype / --device
    model: str | None
    dtype: str
    device: str
    concurrency: tuple[int, ...] = CONCURRENCY
    waves: int = WAVES
    reps: int = 3                   # repetitions per level, modes interleaved
    max_new_tokens: int = 64
    block_size: int | None = None   # cap on draft tokens per round (default: the drafter's trained block)
    prompt_lookup: bool = False     # the DSpark server puts prompt lookup in front of its drafter
    smoke: bool = False             # `--quick`

    @classmethod
    def from_args(cls, args, home: Path, checkpoint: Path) -> "ServeBenchConfig":
        quick = bool(args.quick)
        return cls(checkpoint=checkpoint, home=home, target=args.target or DEFAULT_TARGET, model=args.model,
                   dtype=args.dtype, device=args.device, concurrency=(1, 4) if quick else CONCURRENCY,
                   waves=args.waves or WAVES, reps=1 if quick else max(1, args.reps or 3),
                   max_new_tokens=args.max_new_tokens or (32 if quick else 64), block_size=args.block_size,
                   prompt_lookup=bool(args.prompt_lookup), smoke=quick)

    def requests(self, c: int) -> int:
        """Requests per level: ``waves`` x c, at least 8 (the smoke run: c, at least 2)."""
        return max(2, c) if self.smoke else max(8, self.waves * c)


def _find_code_drafter(home: Path) -> Path | None:
    found = sorted((home / "bench").glob("drafters-*/dspark-code/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(cfg: ServeBenchConfig, load_target, prompts: list[list[int]], kit) -> tuple[Path, Path]:
    """Calibration + SPS(B) per concurrency for the drafter (cached by target, drafter, dtype, device)."""
    target = load_target()
    ckpt = cfg.checkpoint
    hw = hardware_fingerprint(target.runner)        # a DSPARK_HOME kept across machines re-profiles on each
    ident = [target.fingerprint, str(ckpt.resolve()), (ckpt / "model.safetensors").stat().st_mtime,
             str(target.runner.dtype), cfg.device, list(cfg.concurrency), "despike-1", cfg.block_size,
             {k: hw.get(k) for k in HARDWARE_KEYS}]
    key = hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:12]
    cache = cfg.home / "bench" / f"serve-{key}"
    cal_path, sps_path = cache / "calibration.json", cache / "sps.json"
    if cal_path.exists() and sps_path.exists():
        kit.log(f"[serve] reusing calibration and SPS tables from {cache}")
        return cal_path, sps_path
    cache.mkdir(parents=True, exist_ok=True)
    prop = build_proposer("dspark", target.runner, target.fingerprint, ckpt, block_size=cfg.block_size)
    try:
        conf, acc = collect_rounds(target.runner, prop, prompts[:6], 96, 0.0, target.stop_token_ids)
    except ValueError as e:
        raise kit.error(str(e).split(";")[0], "calibration needs a DSpark drafter (it has a confidence head)") from None
    cal = fit_sts(conf, acc, STSConfig(min_rounds=100, shift=True))
    cal_path.write_text(json.dumps(cal.to_dict(), indent=2))
    kit.log(f"[serve] STS on {cal.rounds} code rounds: ECE {[round(m['ece'], 3) for m in cal.raw]} -> "
            f"{[round(m['ece'], 3) for m in cal.calibrated]}")
    block = prop.max_block
    tables = {}
    for c in cfg.concurrency:
        # B up to c + 48 at most: beyond it SPSTable extrapolates linearly (profiling every B costs minutes)
        prof = profile_sps(target.runner, prop, c + min(c * block, 48), reps=2 if c <= 4 else 1, context=160,
                           block=block, rows=c)
        prof["sps"] = smooth_sps(prof["measured"], c)
        tables[str(c)] = prof
        kit.log(f"[serve] SPS R={c}: {prof['sps'][c - 1]:.1f} steps/s at B={c}, "
                f"{prof['sps'][-1]:.1f} at B={len(prof['sps'])}")
    sps_path.write_text(json.dumps({"tables": tables}, indent=2))
    return cal_path, sps_path


def smooth_sps(measured: list[float], rows: int) -> list[float]:
    """SPS(B) from a noisy profile: step times for B > rows are replaced by the median of a 5-wide window
    (a descheduled measurement on a shared CPU is one spike), then made non-increasing. The shape stays:
    the jump from B = rows (no drafting) to B = rows + 1 (a drafting pass) and the steps where the padded
    verify length grows are real costs the scheduler must see."""
    times = [1.0 / s for s in measured]
    out = times[:rows]
    for b in range(rows, len(times)):
        window = sorted(times[max(rows, b - 2):b + 3])
        out.append(window[len(window) // 2])
    return list(SPSTable.monotone([1.0 / t for t in out]).sps)


class _Server:
    """``dspark serve`` in a subprocess, ready when /health answers."""

    def __init__(self, cfg: ServeBenchConfig, mode: str, drafter_dir: Path, sps: Path, landing: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dspark_core.cli", "serve", "--port", str(self.port), "--target", cfg.target,
               "--dtype", cfg.dtype, "--device", cfg.device, "--max-batch", str(max(cfg.concurrency)),
               "--poll-interval", "0", "--domains", "code", "--default-domain", "code", "--no-registry",
               "--log-level", "warning", "--policy", "none" if mode == "none" else "scheduled",
               "--drafter-dir", str(drafter_dir), "--sps", str(sps)]
        if cfg.model:
            cmd += ["--model", cfg.model]
        if cfg.block_size:
            cmd += ["--max-draft-tokens", str(cfg.block_size)]
        if mode != "none" and cfg.prompt_lookup:
            cmd += ["--prompt-lookup"]
        # a token of its own: the bench reads the live gate's state from the admin API after each level
        self.admin_token = secrets.token_urlsafe(16)
        env = {**os.environ, "DSPARK_LANDING": str(landing), "DSPARK_HOME": str(cfg.home),
               "DSPARK_ADMIN_TOKEN": self.admin_token}
        landing.mkdir(parents=True, exist_ok=True)
        self.log_path = landing.parent / f"serve-{mode}.log"          # a file: a full pipe would stall the server
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"dspark serve exited with {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("dspark serve did not become ready")

    def live_gate(self) -> dict | None:
        """The server's live gate per concurrency bucket (``LiveGate.describe``: steps and tok/s of each arm,
        the bracket's ratio, the arm running), or None for a policy without one."""
        import httpx
        got = httpx.get(self.url + "/admin/drafters", timeout=30,
                        headers={"Authorization": f"Bearer {self.admin_token}"})
        got.raise_for_status()
        return got.json().get("live_gate")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


async def _one(client, url: str, model: str, ids: list[int], max_tokens: int, domain: str | None) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if domain:
        body["domain"] = domain
    t0 = time.perf_counter()
    first, last, itl, tokens, info = None, None, [], [], {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            got = [t for ch in obj.get("choices", []) for t in ch.get("token_ids", [])]
            info = obj.get("dspark", info)
            if got:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    itl.extend([(now - last) / len(got)] * len(got))
                last = now
                tokens.extend(got)
    t1 = time.perf_counter()
    return {"ttft": first or 0.0, "itl": itl, "tokens": tokens, "wall": t1 - t0, "info": info}


async def _level(url: str, model: str, prompts: list[list[int]], c: int, n_req: int, max_tokens: int,
                 domain: str | None, warm_up: bool = True) -> dict:
    import httpx
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def run(i):
            async with sem:
                return await _one(client, url, model, prompts[i % len(prompts)], max_tokens, domain)
        # an unmeasured warm-up wave at this concurrency (both modes): caches, and the live gate's estimates
        if warm_up:
            warm = [prompts[-1 - i % len(prompts)] for i in range(c)]
            await asyncio.gather(*(_one(client, url, model, ids, 24, domain) for ids in warm))
        t0 = time.perf_counter()
        res = await asyncio.gather(*(run(i) for i in range(n_req)))
        wall = time.perf_counter() - t0
    return {"res": res, "wall": wall}


def _summary(runs: list[dict]) -> dict:
    """One level's repetitions -> medians of output and per-user tok/s over repetitions; TTFT and ITL
    percentiles over every request of every repetition; outputs of the first repetition."""
    res = [r for run in runs for r in run["res"]]
    itl = [x for r in res for x in r["itl"]]
    ttft = [r["ttft"] for r in res]
    toks = sum(len(r["tokens"]) for r in res)
    drafted = sum(r["info"].get("drafted", 0) for r in res)
    accepted = sum(r["info"].get("accepted", 0) for r in res)
    rounds = sum(r["info"].get("rounds", 0) for r in res)
    out_rep = [sum(len(r["tokens"]) for r in run["res"]) / run["wall"] for run in runs]
    user_rep = [statistics.median(len(r["tokens"]) / r["wall"] for r in run["res"]) for run in runs]
    return {"requests": len(runs[0]["res"]), "reps": len(runs),
            "output_tok_s": round(statistics.median(out_rep), 2),
            "per_user_tok_s": round(statistics.median(user_rep), 2),
            "output_tok_s_reps": [round(x, 2) for x in out_rep], "per_user_tok_s_reps": [round(x, 2) for x in user_rep],
            "ttft_ms": {p: round(1000 * _pct(ttft, q), 1) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "itl_ms": {p: round(1000 * _pct(itl, q), 2) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
            "tokens_per_round": round(toks / rounds, 3) if rounds else None,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "outputs": [r["tokens"] for r in runs[0]["res"]]}


def _code_prompts(cfg: ServeBenchConfig, kit) -> list[list[int]]:
    """The held-out code prompts of the chosen target (its fingerprint read from its manifest)."""
    fp = None
    if not cfg.model:
        manifest = resolve_target_dir(cfg.target, cfg.home) / "dspark_target.json"
        fp = json.loads(manifest.read_text())["fingerprint"]
    prompts = [list(r.prompt_ids) for r in heldout_records(cfg.home, "code", fp)]
    if not prompts:
        raise kit.error("no held-out code prompts", "run: dspark traces bootstrap --domains code")
    return prompts


def _drafter_dir(ckpt: Path, calibration: Path) -> Path:
    """A drafters folder for ``dspark serve --drafter-dir``: the checkpoint as domain code, calibrated."""
    work = Path(tempfile.mkdtemp(prefix="dspark-bench-serve-"))
    (work / "drafters" / "code").mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (work / "drafters" / "code" / f).symlink_to((ckpt / f).resolve())
    (work / "drafters" / "code" / "calibration.json").write_text(calibration.read_text())
    return work


def _measure(cfg: ServeBenchConfig, work: Path, sps: Path, prompts: list[list[int]], log) -> tuple[dict, dict]:
    """Both servers run side by side (an idle one only waits on its queue); each level is repeated ``reps``
    times with the modes interleaved, so drift of the shared machine hits both alike. Returns the runs per
    mode and level, and the DSpark server's live gate after each level."""
    servers = {}
    try:
        for mode in MODES:
            servers[mode] = _Server(cfg, mode, work / "drafters", sps, work / f"landing-{mode}")
        for srv in servers.values():
            srv.wait_ready()
        model = json.loads(_get(servers["none"].url + "/v1/models"))["data"][0]["id"]
        runs: dict = {m: {str(c): [] for c in cfg.concurrency} for m in MODES}
        gate_after: dict = {}
        for c in cfg.concurrency:
            for rep in range(cfg.reps):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):   # a steady drift favours neither
                    one = asyncio.run(_level(servers[mode].url, model, prompts, c, cfg.requests(c), cfg.max_new_tokens,
                                             "code" if mode == "dspark" else None, warm_up=rep == 0))
                    runs[mode][str(c)].append(one)
                    got = _summary([one])
                    log(f"[serve] {mode:6s} c={c:2d} rep {rep + 1}/{cfg.reps}: {got['output_tok_s']:7.1f} tok/s total, "
                        f"{got['per_user_tok_s']:6.1f} tok/s per user, TTFT p50 {got['ttft_ms']['p50']:.0f} ms, "
                        f"ITL p50 {got['itl_ms']['p50']:.1f} ms"
                        + (f", {got['tokens_per_round']:.2f} tok/round" if got["tokens_per_round"] else ""))
            # what the DSpark server's gate did at this level's bucket (cumulative: one gate serves the whole
            # run): speculative against plain steps separates the cost of its explorations from that of
            # carrying the drafter through plain steps
            gate_after[str(c)] = servers["dspark"].live_gate()
            said = _gate_at(gate_after[str(c)], c)
            if said:
                log(f"[serve] live gate, {said}")
    finally:
        for srv in servers.values():
            srv.close()
    return runs, gate_after


def _result(cfg: ServeBenchConfig, runs: dict, gate_after: dict, wall_seconds: float) -> dict:
    results = {m: {c: _summary(rs) for c, rs in runs[m].items()} for m in MODES}
    mismatches = {c: sum(a != b for a, b in zip(results["none"][c].pop("outputs"), results["dspark"][c].pop("outputs")))
                  for c in results["none"]}

    def paired(c, key):       # per repetition, DSpark over the no-speculation run beside it; the median
        a, b = results["dspark"][c][key + "_reps"], results["none"][c][key + "_reps"]
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)
    ratio = {c: {"per_user": round(results["dspark"][c]["per_user_tok_s"] / results["none"][c]["per_user_tok_s"], 3),
                 "output": round(results["dspark"][c]["output_tok_s"] / results["none"][c]["output_tok_s"], 3),
                 "per_user_paired": paired(c, "per_user_tok_s"), "output_paired": paired(c, "output_tok_s")}
             for c in results["none"]}
    low, top = str(min(cfg.concurrency)), str(max(cfg.concurrency))
    return {"suite": "serve", "quick": cfg.smoke, "checkpoint": str(cfg.checkpoint), "dtype": cfg.dtype,
            "device": cfg.device, "max_draft_tokens": cfg.block_size, "prompt_lookup": cfg.prompt_lookup,
            "max_new_tokens": cfg.max_new_tokens, "concurrency": list(cfg.concurrency), "reps": cfg.reps,
            "waves": None if cfg.smoke else cfg.waves, "modes": results, "ratio_dspark_vs_none": ratio,
            "greedy_output_mismatches": mismatches, "gate": gate_after,
            "goals": {f"c{low}_per_user_x": ratio[low]["per_user"], f"c{low}_per_user_goal": 1.3,
                      f"c{top}_output_x": ratio[top]["output"], f"c{top}_output_goal": 1.0},
            "wall_seconds": round(wall_seconds, 1)}


def run(args, settings, kit) -> dict:
    """The ``serve`` bench suite (entry point ``dspark.bench_suites``), called by ``dspark bench`` with its
    checked options, its settings (``settings.home``) and its :class:`CommandKit` (``kit.error``,
    ``kit.load_target``, ``kit.log``)."""
    ckpt = Path(args.checkpoint) if args.checkpoint else _find_code_drafter(settings.home)
    if ckpt is None:
        raise kit.error("no trained code drafter", "pass --checkpoint or run dspark bench --suite drafters first")
    cfg = ServeBenchConfig.from_args(args, settings.home, ckpt)
    prompts = _code_prompts(cfg, kit)
    t_start = time.perf_counter()
    cal, sps = _prepare(cfg, lambda: kit.load_target(args, settings), prompts, kit)
    runs, gate_after = _measure(cfg, _drafter_dir(ckpt, cal), sps, prompts, kit.log)
    return _result(cfg, runs, gate_after, time.perf_counter() - t_start)


def _get(url: str) -> str:
    import httpx
    return httpx.get(url, timeout=30).text


def _gate_at(state: dict | None, c: int) -> str | None:
    """One line on a live gate's state (``LiveGate.describe``) at the bucket of ``c`` rows, or None."""
    at = (state or {}).get(str(LiveGate.bucket(c)))
    if not at:
        return None
    price = (f"; a bracket costs {at['bracket_cost_steps']} steps, next after {at['explore_interval']}"
             if at.get("bracket_cost_steps") is not None else "")
    return (f"c = {c}: {at['spec']['steps']} speculative / {at['plain']['steps']} plain steps "
            f"(bracket {at['spec_vs_plain']}, running {at['running']}{price})")


def render_markdown(result: dict) -> str:
    lines = ["| c | mode | output tok/s | per-user tok/s | TTFT p50 / p90 ms | ITL p50 / p90 / p99 ms | tok/round "
             "| acceptance |", "|---|---|---|---|---|---|---|---|"]
    for c in (str(x) for x in result["concurrency"]):
        for mode in MODES:
            r = result["modes"][mode][c]
            lines.append(f"| {c} | {mode} | {r['output_tok_s']:.1f} | {r['per_user_tok_s']:.1f} | "
                         f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p90']:.0f} | "
                         f"{r['itl_ms']['p50']:.1f} / {r['itl_ms']['p90']:.1f} / {r['itl_ms']['p99']:.1f} | "
                         f"{r['tokens_per_round'] or '-'} | "
                         f"{r['acceptance'] if r['acceptance'] is not None else '-'} |")
        rt = result["ratio_dspark_vs_none"][c]
        pair = (f" (paired {rt['output_paired']:.2f}x)", f" (paired {rt['per_user_paired']:.2f}x)") \
            if "output_paired" in rt else ("", "")
        lines.append(f"| {c} | **dspark / none** | **{rt['output']:.2f}x**{pair[0]} | "
                     f"**{rt['per_user']:.2f}x**{pair[1]} | | | | |")
    gate = result.get("gate") or {}
    seen = [said for c in result["concurrency"] if (said := _gate_at(gate.get(str(c)), c))]
    if seen:
        lines += ["", "Live gate of the DSpark server at each level's bucket, cumulative: " + "; ".join(seen) + "."]
    lines += ["", f"Greedy output mismatches none vs dspark per concurrency: {result['greedy_output_mismatches']} "
              f"(dtype {result['dtype']}; in bf16 a near-tie may flip)."]
    return "\n".join(lines) + "\n"


run.render = render_markdown

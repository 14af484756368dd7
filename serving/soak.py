"""``dspark bench --suite soak``: the real server under abuse and load for minutes, not a unit test.

``dspark serve`` runs in a subprocess with the code drafter (a local drafter folder, calibrated) and
writes traces to a landing folder of its own. ``clients`` concurrent clients (32 by default) send, for
``duration`` seconds (600; ``--quick`` 60 with 8 clients), a seeded random mix of valid requests (completions
and chat, streaming and not, greedy and sampled) and invalid ones (malformed JSON, out-of-range fields,
lone surrogates, oversized bodies, unknown routes, unsupported fields). Meanwhile the admin API hot-swaps
the code drafter twice and rolls it back once, a warehouse ingest of the landing folder runs every 20
seconds, ``/health`` is probed every second, and the server's RSS is sampled from ``/proc``.

Reported (the JSON): ``requests``, ``status_counts``, ``errors_5xx``, ``aborted_valid`` (a valid request
answered other than 200, or a stream that ended without its final chunk), ``latency_ms`` {p50, p99} of
valid requests, ``health_ms`` {p50, max}, ``rss_mb`` {after_warmup, peak, end, around each admin action},
``traces`` {written
(lines in the landing files after the server stopped), ingested, quarantined, duplicates}, and the admin
actions with their answers. Goal: no 5xx, no aborted valid request, RSS flat after warm-up, and every
trace written either ingested or quarantined.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from serving.bench import (ServeBenchConfig, _code_prompts, _drafter_dir, _find_code_drafter, _free_port, _pct,
                           _prepare)

CLIENTS, DURATION = 32, 600.0
INVALID_SHARE = 0.2
INGEST_EVERY = 20.0


@dataclass(frozen=True)
class SoakConfig:
    serve: ServeBenchConfig          # target, dtype, home, checkpoint (what the serve suite uses)
    clients: int = CLIENTS
    duration: float = DURATION
    max_new_tokens: int = 32
    seed: int = 0

    @classmethod
    def from_args(cls, args, home: Path, checkpoint: Path) -> "SoakConfig":
        quick = bool(args.quick)
        serve = ServeBenchConfig.from_args(args, home, checkpoint)
        serve = dataclasses.replace(serve, concurrency=(1, 4) if quick else (1, 8), reps=1, smoke=quick)
        return cls(serve=serve, clients=8 if quick else CLIENTS, duration=60.0 if quick else DURATION,
                   max_new_tokens=args.max_new_tokens or 32)


def _body(rng: random.Random, prompts: list[list[int]], texts: list[str], max_new: int) -> dict:
    """One request: ``{"path", "content" (bytes), "valid", "stream", "kind"}``."""
    stream = rng.random() < 0.5
    if rng.random() >= INVALID_SHARE:
        sampled = rng.random() < 0.3
        common = {"max_tokens": rng.randint(4, max_new), "stream": stream, "temperature": 0.7 if sampled else 0,
                  **({"seed": rng.randint(0, 2**32)} if sampled else {}), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.5:
            body = {"model": "dspark", "prompt": rng.choice(prompts), "domain": "code", **common}
            return {"path": "/v1/completions", "content": json.dumps(body).encode(), "valid": True,
                    "stream": stream, "kind": "completion"}
        body = {"model": "dspark:code", "messages": [{"role": "user", "content": rng.choice(texts)}], **common}
        return {"path": "/v1/chat/completions", "content": json.dumps(body).encode(), "valid": True,
                "stream": stream, "kind": "chat"}
    kind = rng.choice(["bad_json", "bad_field", "surrogate", "oversized", "huge_seed", "unknown_route", "n2",
                       "empty_messages", "huge_top_k"])
    base = {"model": "dspark", "prompt": "hello", "max_tokens": 8, "stream": stream}
    content = {
        "bad_json": b'{"model": "dspark", "prompt": ',
        "bad_field": json.dumps({**base, "temperature": -1}).encode(),
        "surrogate": json.dumps({**base, "prompt": "a\ud800b"}).encode(),
        "oversized": json.dumps({**base, "prompt": "x" * (2 << 20)}).encode(),
        "huge_seed": json.dumps({**base, "seed": 2**70}).encode(),
        "unknown_route": b"{}",
        "n2": json.dumps({**base, "n": 2}).encode(),
        "empty_messages": json.dumps({"model": "dspark", "messages": []}).encode(),
        "huge_top_k": json.dumps({**base, "top_k": 10**12}).encode(),
    }[kind]
    path = "/v1/nowhere" if kind == "unknown_route" else (
        "/v1/chat/completions" if kind == "empty_messages" else "/v1/completions")
    return {"path": path, "content": content, "valid": False, "stream": stream, "kind": kind}


async def _request(client, url: str, req: dict) -> dict:
    t0 = time.perf_counter()
    headers = {"content-type": "application/json"}
    complete = False
    try:
        if req["stream"] and req["valid"]:
            async with client.stream("POST", url + req["path"], content=req["content"], headers=headers) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        complete = True
                    elif line.startswith("data: ") and '"error"' in line:
                        complete = False
                        break
        else:
            r = await client.post(url + req["path"], content=req["content"], headers=headers)
            status = r.status_code
            complete = status == 200 and bool(r.json().get("choices")) if req["valid"] else True
    except Exception as e:                       # noqa: BLE001 - a transport failure is a result here
        return {"status": f"error:{type(e).__name__}", "ms": (time.perf_counter() - t0) * 1e3, "valid": req["valid"],
                "complete": False, "kind": req["kind"]}
    return {"status": status, "ms": (time.perf_counter() - t0) * 1e3, "valid": req["valid"],
            "complete": complete, "kind": req["kind"]}


async def _clients(url: str, cfg: SoakConfig, prompts: list[list[int]], texts: list[str]) -> list[dict]:
    import httpx
    end = time.perf_counter() + cfg.duration
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=cfg.clients + 8)) as client:
        async def one(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            while time.perf_counter() < end:
                out.append(await _request(client, url, _body(rng, prompts, texts, cfg.max_new_tokens)))
        await asyncio.gather(*(one(i) for i in range(cfg.clients)))
    return out


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Beside(threading.Thread):
    """What runs beside the clients: health probes and RSS samples every second, the admin actions at
    their times, a warehouse ingest every :data:`INGEST_EVERY` seconds."""

    def __init__(self, url: str, token: str, pid: int, cfg: SoakConfig, landing: Path, db: Path, log):
        super().__init__(daemon=True)
        self.url, self.token, self.pid, self.cfg, self.landing, self.db, self.log = url, token, pid, cfg, landing, db, log
        self.stop = threading.Event()
        self.health_ms: list[float] = []
        self.health_fail = 0
        self.rss: list[tuple[float, float]] = []
        self.actions: list[dict] = []
        self.ingests = 0

    def _admin(self, what: str, path: str, body: dict) -> None:
        import httpx
        r = httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {self.token}"}, timeout=120)
        self.actions.append({"t": round(time.perf_counter() - self.t0, 1), "action": what, "status": r.status_code,
                             "drafter": r.json().get("drafter") if r.status_code == 200 else r.json()})
        self.log(f"[soak] {what}: HTTP {r.status_code}")

    def _ingest(self) -> None:
        from registry.warehouse import TraceWarehouse
        with TraceWarehouse(self.db) as wh:
            wh.ingest_landing(self.landing)
        self.ingests += 1

    def run(self) -> None:
        import httpx
        self.t0 = time.perf_counter()
        plan = [(1 / 3, "hot-swap", "/admin/drafters/code/reload", {"reason": "soak swap 1"}),
                (1 / 2, "rollback", "/admin/drafters/code/rollback", {"reason": "soak rollback"}),
                (2 / 3, "hot-swap", "/admin/drafters/code/reload", {"reason": "soak swap 2"})]
        next_ingest = INGEST_EVERY
        while not self.stop.wait(1.0):
            t = time.perf_counter() - self.t0
            h0 = time.perf_counter()
            try:
                ok = httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.health_ms.append((time.perf_counter() - h0) * 1e3)
            self.health_fail += not ok
            rss = _rss_mb(self.pid)
            if rss is not None:
                self.rss.append((t, rss))
            while plan and t >= plan[0][0] * self.cfg.duration:
                _, what, path, body = plan.pop(0)
                self._admin(what, path, body)
            if t >= next_ingest:
                self._ingest()
                next_ingest += INGEST_EVERY


def _start_server(cfg: SoakConfig, drafters: Path, sps: Path, landing: Path, token: str, work: Path):
    s = cfg.serve
    port = _free_port()
    cmd = [sys.executable, "-m", "dspark_core.cli", "serve", "--port", str(port), "--target", s.target,
           "--dtype", s.dtype, "--device", s.device, "--max-batch", "16", "--poll-interval", "0",
           "--domains", "code", "--default-domain", "code", "--no-registry", "--log-level", "warning",
           "--policy", "scheduled", "--drafter-dir", str(drafters), "--sps", str(sps)]
    if s.model:
        cmd += ["--model", s.model]
    env = {**os.environ, "DSPARK_LANDING": str(landing), "DSPARK_HOME": str(s.home),
           "DSPARK_ADMIN_TOKEN": token}
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}", log


def _wait_ready(proc, url: str, work: Path, timeout: float = 300.0) -> None:
    import httpx
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"dspark serve exited with {proc.returncode}: {(work / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("dspark serve did not become ready")


def _lines(landing: Path) -> int:
    return sum(sum(1 for line in f.open("rb") if line.strip()) for f in landing.rglob("*.jsonl"))


def soak(cfg: SoakConfig, kit, load_target) -> dict:
    """Run the soak (see the module docstring); ``load_target()`` loads the target once, for the
    calibration and SPS(B) profile the server is given."""
    prompts = _code_prompts(cfg.serve, kit)
    t_start = time.perf_counter()
    cal, sps = _prepare(cfg.serve, load_target, prompts, kit)
    work = Path(tempfile.mkdtemp(prefix="dspark-soak-"))
    drafters = _drafter_dir(cfg.serve.checkpoint, cal) / "drafters"
    landing, db = work / "landing", work / "warehouse.duckdb"
    token = secrets.token_urlsafe(16)
    texts = ["Write a Python function that checks whether a number is prime.",
             "Explain what a hash map is and give a short example in Python.",
             "Write a function that reverses the words of a sentence.",
             "How do I read a JSON file in Python?"]
    proc, url, server_log = _start_server(cfg, drafters, sps, landing, token, work)
    try:
        _wait_ready(proc, url, work)
        beside = _Beside(url, token, proc.pid, cfg, landing, db, kit.log)
        beside.start()
        kit.log(f"[soak] {cfg.clients} clients for {cfg.duration:.0f} s against {url}")
        results = asyncio.run(_clients(url, cfg, prompts, texts))
        beside.stop.set()
        beside.join(120)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        server_log.close()
    from registry.warehouse import TraceWarehouse
    with TraceWarehouse(db) as wh:
        wh.ingest_landing(landing)
        totals = wh.totals()
    written = _lines(landing)
    status, by_kind = {}, {}
    for r in results:
        status[str(r["status"])] = status.get(str(r["status"]), 0) + 1
        kind = by_kind.setdefault(r["kind"], {})
        kind[str(r["status"])] = kind.get(str(r["status"]), 0) + 1
    valid = [r for r in results if r["valid"]]
    lat = sorted(r["ms"] for r in valid if r["status"] == 200)
    warm = [mb for t, mb in beside.rss if t >= min(60.0, cfg.duration / 4)]
    result = {
        "suite": "soak",
        "config": {"clients": cfg.clients, "duration_s": cfg.duration, "invalid_share": INVALID_SHARE,
                   "max_new_tokens": cfg.max_new_tokens, "policy": "scheduled", "dtype": cfg.serve.dtype,
                   "ingest_every_s": INGEST_EVERY},
        "requests": len(results), "valid_requests": len(valid),
        "status_counts": dict(sorted(status.items())),
        "status_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "errors_5xx": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
        "transport_errors": sum(1 for r in results if not isinstance(r["status"], int)),
        "aborted_valid": sum(1 for r in valid if r["status"] != 200 or not r["complete"]),
        "latency_ms": {"p50": round(_pct(lat, 50), 1) if lat else None,
                       "p99": round(_pct(lat, 99), 1) if lat else None},
        "health_ms": {"p50": round(statistics.median(beside.health_ms), 1) if beside.health_ms else None,
                      "max": round(max(beside.health_ms), 1) if beside.health_ms else None,
                      "failed": beside.health_fail},
        "rss_mb": {"after_warmup": round(warm[0], 1) if warm else None,
                   "peak": round(max(mb for _, mb in beside.rss), 1) if beside.rss else None,
                   "end": round(beside.rss[-1][1], 1) if beside.rss else None,
                   "around_actions": rss_around(beside.rss, beside.actions),
                   # every 30 s: where growth happens (around the swaps, or steadily)
                   "timeline": [[round(t), round(mb, 1)] for i, (t, mb) in enumerate(beside.rss) if i % 30 == 0]},
        "traces": {"written": written, "ingested": totals.stored, "quarantined": totals.quarantined,
                   "duplicates": totals.duplicates, "ingests_during_run": beside.ingests},
        "admin_actions": beside.actions,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    return result


def rss_around(samples: list[tuple[float, float]], actions: list[dict], before_s: float = 20.0,
               settle_s: float = 40.0, after_s: float = 40.0) -> list[dict]:
    """RSS (MB) around each admin action at ``t``: the median over the ``before_s`` seconds before it and
    over ``after_s`` seconds from ``settle_s`` after it (past one memory trim), and the step between
    them. A swap keeps the previous drafter for rollback, so the first one adds a drafter's weights;
    later ones should add nothing. None where the samples do not cover a span."""
    out = []
    for a in actions:
        t = a["t"]
        pre = [mb for s, mb in samples if t - before_s <= s < t]
        post = [mb for s, mb in samples if t + settle_s <= s < t + settle_s + after_s]
        b = round(statistics.median(pre), 1) if pre else None
        f = round(statistics.median(post), 1) if post else None
        out.append({"action": a["action"], "t": t, "before": b, "after": f,
                    "step": round(f - b, 1) if b is not None and f is not None else None})
    return out


def run(args, settings, kit) -> dict:
    """The ``soak`` bench suite (entry point ``dspark.bench_suites``)."""
    ckpt = Path(args.checkpoint) if args.checkpoint else _find_code_drafter(settings.home)
    if ckpt is None:
        raise kit.error("no trained code drafter", "pass --checkpoint or run dspark bench --suite drafters first")
    cfg = SoakConfig.from_args(args, settings.home, ckpt)
    return soak(cfg, kit, lambda: kit.load_target(args, settings))


def render_markdown(result: dict) -> str:
    r, t = result, result["traces"]
    lines = ["| requests | valid | 5xx | aborted valid | latency p50 / p99 ms | /health p50 / max ms | "
             "RSS after warm-up / peak / end MB | traces written = ingested + quarantined |",
             "|---|---|---|---|---|---|---|---|",
             f"| {r['requests']} | {r['valid_requests']} | {r['errors_5xx']} | {r['aborted_valid']} | "
             f"{r['latency_ms']['p50']} / {r['latency_ms']['p99']} | {r['health_ms']['p50']} / {r['health_ms']['max']} | "
             f"{r['rss_mb']['after_warmup']} / {r['rss_mb']['peak']} / {r['rss_mb']['end']} | "
             f"{t['written']} = {t['ingested']} + {t['quarantined']} |", "",
             "Status counts: " + ", ".join(f"{k}: {v}" for k, v in r["status_counts"].items()) + ".", "",
             "Admin actions during the run: " + "; ".join(
                 f"{a['action']} at {a['t']} s → HTTP {a['status']}" for a in r["admin_actions"]) + "."]
    around = r["rss_mb"].get("around_actions")
    if around:
        lines += ["", "RSS around them (median MB over 20 s before, and over 40 s from 40 s after): " + "; ".join(
            f"{a['action']} {a['before']} → {a['after']} ({a['step']:+.1f})" if a["step"] is not None
            else f"{a['action']} (not covered)" for a in around) + "."]
    return "\n".join(lines) + "\n"


run.render = render_markdown

"""The closed loop on one machine (``make demo`` = ``dspark flow demo``).

1. prepare the packaged target; 2. bootstrap a small trace set; 3. ``retrain`` (generic drafter, then
per-domain fine-tunes, calibration, SPS(B), registry, gate) unless every domain already has a
champion; 4. start ``dspark serve`` (a subprocess: flows never import serving) with the champions;
5. send it chat/code/math traffic from prompts no drafter has seen; 6. ``retrain`` again on the traces
that traffic produced, with the server's URL and admin token set, so each promotion is hot-swapped
into the running server; 7. a short burst of traffic on the swapped drafters; 8. the before/after table.

Everything lands under ``DSPARK_HOME``; a second run reuses the target, the traces, the champions and
every cached flow step.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prefect import flow

from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces
from dspark_core.data.features import training_taps
from dspark_core.data.prompts import load_prompts
from dspark_core.model.target import DEFAULT_TARGET, prepare_smollm2

from . import tasks
from .results import DomainOutcome
from .retrain import retrain
from .settings import FlowSettings

DOMAINS = ("chat", "code", "math")
# On top of the quick budget: a generic drafter worth warm-starting from, short first fine-tunes, and a
# longer second round on the served traffic (so the loop has something to promote); calibration on every
# held-out prompt with longer answers (the held-out quarter of 20 prompts gives ~100 fully verified rounds).
# ~10-12 min on 2 CPU cores.
CALIBRATION = {"calib_prompts": 8, "calib_max_new_tokens": 96, "min_rounds": 40}
FIRST_BUDGET = {"generic_steps": 300, "steps": 30, **CALIBRATION}
SECOND_BUDGET = {"generic_steps": 300, "steps": 100, **CALIBRATION}


@dataclass(frozen=True)
class Traffic:
    """One burst of client requests: how many were sent and failed, completion tokens and wall time."""

    requests: int
    errors: int
    tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DemoSummary:
    """The closed loop's outcome: the first retrain's results (None when every domain had a champion
    already), the second's, the before/after table, both traffic bursts, what serving had loaded after
    the swap (its admin API's answer) and the wall time."""

    first: dict[str, DomainOutcome] | None
    second: dict[str, DomainOutcome]
    table: str
    traffic: Traffic
    after_traffic: Traffic
    loaded_after: dict
    seconds: float

    def to_dict(self) -> dict:
        return {"first": None if self.first is None else {d: o.to_dict() for d, o in self.first.items()},
                "second": {d: o.to_dict() for d, o in self.second.items()}, "table": self.table,
                "traffic": self.traffic.to_dict(), "after_traffic": self.after_traffic.to_dict(),
                "loaded_after": self.loaded_after, "seconds": self.seconds}


def _step(n: int, total: int, msg: str) -> None:
    print(f"\n[demo {n}/{total}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``dspark serve`` in a subprocess, stopped with SIGTERM (it drains and flushes its traces)."""

    def __init__(self, home: Path, domains: list[str], token: str, shadow: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log_path = home / "demo" / "server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DSPARK_ADMIN_TOKEN": token}
        cmd = [sys.executable, "-m", "dspark_core.cli", "serve", "--port", str(self.port), "--domains",
               ",".join(domains), "--shadow-fraction", str(shadow), "--poll-interval", "15", "--max-batch", "4"]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=600, headers={"Authorization": f"Bearer {token}"})

    def wait_ready(self, timeout: float = 240) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dspark serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"dspark serve not ready after {timeout:.0f} s; see {self.log_path}")

    def drafters(self) -> dict:
        return self.http.get("/admin/drafters").json()["domains"]

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        self._log.close()


def _traffic(server: _Server, prompts: list[tuple[str, str]], max_tokens: int, concurrency: int) -> Traffic:
    """Chat requests (one per (domain, prompt)), ``concurrency`` at a time; returns counts and tok/s."""
    model = server.http.get("/v1/models").json()["data"][0]["id"]

    def one(item):
        domain, text = item
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0.7, "top_p": 0.9, "domain": domain}
        r = server.http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return domain, r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    out: dict[str, int] = {}
    errors = 0
    with ThreadPoolExecutor(concurrency) as pool:
        for fut in [pool.submit(one, p) for p in prompts]:
            try:
                d, n = fut.result()
                out[d] = out.get(d, 0) + n
            except httpx.HTTPError as e:
                errors += 1
                print(f"  request failed: {e}")
    wall = time.perf_counter() - t0
    tokens = sum(out.values())
    print(f"  {len(prompts)} requests, {errors} errors, {tokens} tokens in {wall:.0f} s "
          f"({tokens / wall:.1f} tok/s at concurrency {concurrency})")
    return Traffic(requests=len(prompts), errors=errors, tokens=tokens, seconds=round(wall, 1))


def _wait_traces(server: _Server, expected: float, timeout: float = 60) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        written = server.metric("dspark:trace_records_written_total")
        if written >= expected:
            return written
        time.sleep(1)
    return server.metric("dspark:trace_records_written_total")


def _live(drafters: dict) -> dict:
    out = {}
    for d, info in drafters.items():
        dr = info.get("drafter") or {}
        live = dr.get("live") or {}
        out[d] = {"version": dr.get("version"), "live": live}
    return out


def _fmt(x, spec=".2f", suffix="") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _worst(v) -> float | None:
    if not v:
        return None
    return max(v) if isinstance(v, (list, tuple)) else float(v)


def render_table(results: dict[str, DomainOutcome], loaded_after: dict) -> str:
    rows = ["| domain | champion before | tau before -> after | speedup before -> after | "
            "worst ECE (STS) before -> after | gate | serving now |", "|---|---|---|---|---|---|---|"]
    for d, o in results.items():
        b, a = o.before, o.after
        ece_b, ece_a = _worst(b.ece_calibrated if b else None), _worst(a.get("ece_calibrated"))
        rows.append(f"| {d} | {'v' + str(b.version) if b else 'none'} | "
                    f"{_fmt(b.tau if b else None)} -> {_fmt(a.get('tau'))} | "
                    f"{_fmt(b.speedup if b else None, suffix='x')} -> "
                    f"{_fmt(a.get('speedup'), suffix='x')} | {_fmt(ece_b, '.3f')} -> {_fmt(ece_a, '.3f')} | "
                    f"v{o.version} {o.decision} | v{loaded_after.get(d, {}).get('version')} |")
    return "\n".join(rows)


# One function on purpose: the eight numbered steps of the module docstring, read top to bottom.
@flow(name="closed_loop_demo", log_prints=True)
def closed_loop_demo(domains: list[str] | None = None, per_domain: int = 20, traffic_per_domain: int = 12,
                     max_tokens: int = 96, concurrency: int = 4, first_overrides: dict | None = None,
                     second_overrides: dict | None = None, shadow_fraction: float = 0.25) -> DemoSummary:
    """The whole loop once; returns the before/after results, traffic figures and the table."""
    t_start = time.perf_counter()
    total = 8
    domains = list(domains or DOMAINS)
    s = FlowSettings.from_env()
    home = s.home

    _step(1, total, f"target {s.target} (DSPARK_HOME={home})")
    if s.target == DEFAULT_TARGET and not (home / "targets" / DEFAULT_TARGET).exists():
        prepare_smollm2(home, log=print)
    target = tasks.load_target(s.target, str(home), s.dtype)

    _step(2, total, f"bootstrap traces: {per_domain} prompts per domain, the target's own answers")
    # the training sequences' target features are kept as they are generated: training reads them back
    bootstrap_traces(target, home, BootstrapConfig(tuple(domains), per_domain, seed=0, batch_size=8,
                                                   max_new_tokens=max_tokens, heldout_fraction=0.25,
                                                   feature_taps=training_taps(target.runner.arch)), log=print)

    _step(3, total, "first drafters: generic + per-domain fine-tunes, calibration, SPS(B), registry, gate")
    champions = {d: tasks.champion(s.registry.tracking_uri, s.registry.artifact_location, d) for d in domains}
    if all(c is not None for c in champions.values()):
        print("  every domain has a champion already: " + ", ".join(f"{d} v{c.version}" for d, c in champions.items()))
        first = None
    else:
        first = retrain(domains=domains, budget="quick",
                        budget_overrides={**FIRST_BUDGET, **(first_overrides or {})})

    token = secrets.token_urlsafe(16)
    _step(4, total, "start dspark serve with the champions")
    server = _Server(home, domains, token, shadow_fraction)
    try:
        server.wait_ready()
        print(f"  serving at {server.url} (log: {server.log_path})")
        before_live = _live(server.drafters())
        print("  loaded: " + ", ".join(f"{d} v{v['version']}" for d, v in before_live.items()))

        _step(5, total, f"traffic: {traffic_per_domain} new prompts per domain (unseen by any drafter)")
        by_domain = {d: load_prompts(d, per_domain + traffic_per_domain, 0)[per_domain:] for d in domains}
        fresh = [(d, by_domain[d][i].text) for i in range(traffic_per_domain) for d in domains
                 if i < len(by_domain[d])]                          # the domains interleaved
        written_before = server.metric("dspark:trace_records_written_total")
        traffic = _traffic(server, fresh, max_tokens, concurrency)
        written = _wait_traces(server, written_before + traffic.requests - traffic.errors)
        live = _live(server.drafters())
        print(f"  {written:.0f} trace records written to the landing folder; live acceptance: " + ", ".join(
            f"{d} {v['live'].get('acceptance', v['live'])}" for d, v in live.items()))

        _step(6, total, "retrain on the traffic's traces; promotions are hot-swapped into the server")
        os.environ["DSPARK_SERVER_URL"], os.environ["DSPARK_ADMIN_TOKEN"] = server.url, token
        second = retrain(domains=domains, budget="quick",
                         budget_overrides={**SECOND_BUDGET, **(second_overrides or {})})
        loaded = _live(server.drafters())

        _step(7, total, "traffic on the swapped drafters")
        after_traffic = _traffic(server, fresh[:2 * len(domains)], max_tokens, concurrency)
    finally:
        server.stop()
        os.environ.pop("DSPARK_SERVER_URL", None)

    _step(8, total, "before / after")
    table = render_table(second.results, loaded)
    print(table)
    uri = s.registry.tracking_uri
    print(f"\nMLflow UI:  mlflow ui --backend-store-uri {uri} --port 5000   (then open http://127.0.0.1:5000)")
    print(f"Prefect UI: PREFECT_HOME={home / 'prefect'} prefect server start   (then open http://127.0.0.1:4200)")
    print(f"report:     {second.report}")
    seconds = round(time.perf_counter() - t_start, 1)
    print(f"demo finished in {seconds / 60:.1f} min")
    return DemoSummary(first=None if first is None else first.results, second=second.results, table=table,
                       traffic=traffic, after_traffic=after_traffic, loaded_after=loaded, seconds=seconds)

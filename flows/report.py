"""The per-run Markdown report: before/after table per domain (tau, speedup, ECE raw/calibrated), the
gate's reasons and the plots (inlined as PNG data URIs so the Prefect UI shows them)."""

from __future__ import annotations

import base64
from pathlib import Path


def _worst(v) -> float | None:
    if v is None:
        return None
    return max(v) if isinstance(v, (list, tuple)) else float(v)


def _fmt(v, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _img(path: str | None, alt: str, max_bytes: int = 400_000) -> str:
    if not path or not Path(path).exists():
        return ""
    data = Path(path).read_bytes()
    if len(data) > max_bytes:
        return f"{alt}: `{path}`"
    return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})"


def render(summary: dict) -> str:
    """``summary``: what :func:`flows.retrain.retrain` returns (``domains`` -> per-domain outcome)."""
    lines = [f"# dspark retrain ({summary.get('budget', '?')} budget)", "",
             f"target `{summary.get('target_fingerprint', '')[:12]}`, domains: {', '.join(summary['domains']) or 'none'}",
             ""]
    if summary.get("ingest"):
        i = summary["ingest"]
        lines += [f"ingest: {i.get('read', 0)} read, {i.get('stored', 0)} stored, {i.get('quarantined', 0)} "
                  f"quarantined, {i.get('duplicates', 0)} duplicates; warehouse rows {i.get('trace_rows', '?')}", ""]
    if summary.get("drift"):
        lines += [f"drift check: retraining {', '.join(summary['drift'].get('drifted', [])) or 'nothing'}", ""]
    lines += ["| domain | version | decision | tau before | tau after | speedup before | speedup after | "
              "ECE raw (worst) | ECE calibrated (worst) | lossless failures |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for d, o in summary.get("results", {}).items():
        b, a = o.get("before") or {}, o.get("after") or {}
        lines.append(f"| {d} | v{o.get('version', '?')} | {o.get('decision', '?')} | {_fmt(b.get('tau'))} | "
                     f"{_fmt(a.get('tau'))} | {_fmt(b.get('speedup'), '.2f', 'x')} | {_fmt(a.get('speedup'), '.2f', 'x')} | "
                     f"{_fmt(_worst(a.get('ece_raw')), '.4f')} | {_fmt(_worst(a.get('ece_calibrated')), '.4f')} | "
                     f"{a.get('lossless_failures', '-')} |")
    for d, o in summary.get("results", {}).items():
        lines += ["", f"## {d}", "", *[f"- {r}" for r in o.get("reasons", [])]]
        if o.get("handoff"):
            h = o["handoff"]
            lines.append(f"- serving reload: {'ok' if h.get('ok') else 'FAILED (' + str(h.get('error')) + ')'}")
        for path, alt in ((o.get("reliability_plot"), f"{d} reliability"), (o.get("sps_plot"), f"{d} SPS(B)")):
            img = _img(path, alt)
            if img:
                lines += ["", img]
    return "\n".join(lines) + "\n"

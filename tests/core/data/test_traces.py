"""Trace record, offline prompt sources, split, and resumable bootstrap on a tiny target (CPU, hermetic)."""

import hashlib
import json
import random

import pytest

from dspark_core.data import prompts as dl
from dspark_core.data.bootstrap import (BootstrapConfig, bootstrap_file, bootstrap_traces, heldout_records,
                                       load_split, split_file, training_records)
from dspark_core.data.traces import (TRACE_SCHEMA_VERSION, RoundStat, TraceFormatError, TraceRecord, landing_dir,
                                prompt_id_of, read_jsonl, read_jsonl_lenient, write_jsonl)
from tiny_models import tiny_target


def make_record(**kw) -> TraceRecord:
    base = dict(request_id="r-1", timestamp="2025-01-31T12:00:00.123Z", domain="code",
                prompt_id=prompt_id_of("hello"), prompt_ids=[1, 2, 3], completion_ids=[4, 5],
                sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 16},
                target_fingerprint="abc123", drafter="dspark-code:v3",
                rounds=[RoundStat(4, 4, 2, True), RoundStat(4, 3, 3, False)], source="serving",
                finish_reason="stop")
    base.update(kw)
    return TraceRecord(**base)


# ------------------------------------------------------------------------------------------ record
def test_the_calibration_field_is_optional_and_checked():
    cal = {"source": "live", "version": 2, "temperatures": [1.2, 0.9], "shifts": [0.1, -0.3]}
    rec = make_record(calibration=cal)
    assert TraceRecord.from_dict(json.loads(rec.to_json()), "x").calibration == cal
    adapted = {**cal, "request_prior": 10.0}                  # a request sized with its own offset too
    assert TraceRecord.from_dict(json.loads(make_record(calibration=adapted).to_json()), "x").calibration == adapted
    older = json.loads(make_record().to_json())
    del older["calibration"]                                   # a writer from before the field: reads as None
    assert TraceRecord.from_dict(older, "x").calibration is None
    for bad, needle in [({**cal, "source": "guess"}, "calibration.source"), ({**cal, "version": -1}, "calibration.version"),
                        ({**cal, "temperatures": [0.0]}, "calibration.temperatures"),
                        ({**cal, "shifts": [float("nan")]}, "calibration.shifts"),
                        ({**cal, "request_prior": -1.0}, "calibration.request_prior"),
                        ({**cal, "guess": 1}, "must have the keys"),
                        ({"source": "live"}, "must have the keys"), ("live", "must be an object")]:
        with pytest.raises(TraceFormatError, match=needle):
            make_record(calibration=bad)


def test_record_round_trips_through_json_and_files(tmp_path):
    rec = make_record()
    assert rec.schema_version == TRACE_SCHEMA_VERSION
    assert json.loads(rec.to_json())["schema_version"] == TRACE_SCHEMA_VERSION
    assert TraceRecord.from_dict(json.loads(rec.to_json()), "x") == rec
    plain = make_record(drafter=None, rounds=[], source="bootstrap", completion_ids=[])
    path = landing_dir(tmp_path) / "code" / "t.jsonl"
    assert write_jsonl([rec, plain], path) == 2
    write_jsonl([rec], path)                                   # appends
    got = list(read_jsonl(path))
    assert [n for n, _ in got] == [1, 2, 3] and [r for _, r in got] == [rec, plain, rec]
    write_jsonl([plain], path, append=False)                   # overwrites
    assert [r for _, r in read_jsonl(path)] == [plain]


def _mutate(d: dict, dotted: str, value):
    obj = d
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    if value is _DELETE:
        del obj[last]
    else:
        obj[int(last) if isinstance(obj, list) else last] = value


_DELETE = object()


@pytest.mark.parametrize("path,value,field", [
    ("schema_version", 2, "schema_version"),
    ("schema_version", _DELETE, "schema_version"),
    ("request_id", 7, "request_id"),
    ("timestamp", "yesterday", "timestamp"),
    ("timestamp", "2025-01-31T12:00:00", "timestamp"),          # no timezone
    ("domain", "Code!", "domain"),
    ("prompt_id", "xyz", "prompt_id"),
    ("prompt_ids", [], "prompt_ids"),
    ("prompt_ids", [1, -2], "prompt_ids[1]"),
    ("completion_ids", "1 2", "completion_ids"),
    ("completion_ids", [1, True], "completion_ids[1]"),
    ("sampling.temperature", -1, "sampling.temperature"),
    ("sampling.top_p", 0, "sampling.top_p"),
    ("sampling.max_new_tokens", _DELETE, "sampling.max_new_tokens"),
    ("sampling.beam", 2, "sampling.beam"),
    ("target_fingerprint", None, "target_fingerprint"),
    ("drafter", 3, "drafter"),
    ("rounds", {}, "rounds"),
    ("rounds.0.drafted", -1, "rounds[0].drafted"),
    ("rounds.1.accepted", 4, "rounds[1].accepted"),             # accepted > verified
    ("rounds.1.verified", 5, "rounds[1].verified"),             # verified > drafted
    ("rounds.0.full_verify", "yes", "rounds[0].full_verify"),
    ("rounds.1.full_verify", True, "rounds[1].full_verify"),    # full verify but verified < drafted
    ("rounds.0.accepted", 1.5, "rounds[0].accepted"),
    ("source", "replay", "source"),
    ("finish_reason", _DELETE, "finish_reason"),
    ("surprise", 1, "surprise"),
])
def test_every_invalid_field_is_named_with_file_and_line(tmp_path, path, value, field):
    good = make_record().to_dict()
    bad = json.loads(json.dumps(good))
    _mutate(bad, path, value)
    f = tmp_path / "traces" / "x.jsonl"
    f.parent.mkdir()
    f.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError) as e:
        list(read_jsonl(f))
    assert str(e.value).startswith(f"{f}:3: field '{field}'"), str(e.value)
    records, errors = read_jsonl_lenient(f)
    assert len(records) == 1 and [n for n, _ in errors] == [3] and field in errors[0][1]


def test_malformed_json_and_constructor_validation(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text(make_record().to_json() + "\n{not json\n[1, 2]\n")
    with pytest.raises(TraceFormatError, match=rf"^{f}:2: not valid JSON"):
        list(read_jsonl(f))
    records, errors = read_jsonl_lenient(f)
    assert len(records) == 1 and [n for n, _ in errors] == [2, 3] and "JSON object" in errors[1][1]
    with pytest.raises(TraceFormatError, match="field 'accepted'"):
        RoundStat(drafted=3, verified=2, accepted=3, full_verify=False)
    with pytest.raises(TraceFormatError, match="field 'source'"):
        make_record(source="nope")
    assert issubclass(TraceFormatError, ValueError)


# ----------------------------------------------------------------------------------------- sources
def test_sharegpt_reader_streams_all_complete_conversations():
    """Reads the whole packaged file (~125 MB, well under a second): the torn tail record is dropped."""
    first = next(dl.iter_sharegpt())
    assert first["conversations"][0]["from"] == "human"
    assert sum(1 for _ in dl.iter_sharegpt()) == 17_671
    chat = dl.load_prompts("chat", 5, seed=3)
    assert chat == dl.load_prompts("chat", 5, seed=3) != dl.load_prompts("chat", 5, seed=4)
    assert all(0 < len(p.text) <= dl.SHAREGPT_MAX_CHARS and p.domain == "chat" for p in chat)


def test_sharegpt_reader_handles_chunk_boundaries_and_truncation(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i} " * (i + 1)}]} for i in range(30)]
    text = json.dumps(convs, indent=2)
    cut = text[: text.index('"id": "29"')]                      # torn inside the last record
    f = tmp_path / "s.json"
    f.write_text(cut)
    assert [c["id"] for c in dl.iter_sharegpt(f, chunk_chars=37)] == [str(i) for i in range(29)]
    f.write_text(text)
    assert len(list(dl.iter_sharegpt(f, chunk_chars=5))) == 30


def test_humaneval_has_164_wrapped_problems():
    code = dl.humaneval_prompts()
    assert len(code) == 164 and len(set(code)) == 164
    assert code[0].startswith("Complete the following Python function:\n\n```python\nfrom typing import List")
    assert code[0].endswith("```")
    assert len(dl.load_prompts("code", 500, seed=0)) == 164


def test_math_problems_are_distinct_deterministic_and_prefix_stable():
    state = random.getstate()
    a = dl.math_problems(300, seed=1)
    assert random.getstate() == state                           # the global generator is untouched
    assert len(set(a)) == 300 and a == dl.math_problems(300, seed=1)
    assert a[:50] == dl.math_problems(50, seed=1)
    assert a[:20] != dl.math_problems(20, seed=2)
    assert all(t.endswith(dl.MATH_INSTRUCTION) for t in a)
    assert len(dl.MATH_TEMPLATES) >= 8                          # and every template is drawn
    for marker in ("change does", "km per hour", "years old", "gives away", "shares them equally", "% off",
                   "square metre", "panels", "saves", "recipe", "Fencing", "homework"):
        assert any(marker in t for t in a), marker


def test_unknown_domain_lists_the_domains():
    with pytest.raises(ValueError, match="'chat', 'code', 'math'"):
        dl.load_prompts("poetry", 3, 0)


def test_split_is_deterministic_and_stable_when_prompts_are_added():
    small = dl.load_prompts("math", 100, seed=0)
    big = dl.load_prompts("math", 400, seed=0)
    s_small, s_big = dl.split_prompts(small, 0.2, seed=7), dl.split_prompts(big, 0.2, seed=7)
    assert s_small == dl.split_prompts(small, 0.2, seed=7)
    assert all(s_big[k] == v for k, v in s_small.items())
    held = sum(v == "heldout" for v in s_big.values())
    assert 40 <= held <= 120                                    # ~80 expected
    assert dl.split_prompts(big, 0.2, seed=8) != s_big


# --------------------------------------------------------------------------------------- bootstrap
VOCAB = 64


def fake_encode(text: str) -> list[int]:
    """A stand-in chat-template encoder: a few ids < vocab, fixed by the text."""
    return [1 + b % (VOCAB - 1) for b in hashlib.sha1(text.encode()).digest()[:5]]


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=2)


def run_bootstrap(target, home, **kw):
    encode = kw.pop("encode", fake_encode)
    args = dict(domains=["code", "math"], per_domain=6, seed=0, batch_size=3, max_new_tokens=5,
                heldout_fraction=0.3)
    args.update(kw)
    return bootstrap_traces(target, home, BootstrapConfig(**args), encode=encode, progress=False)


def landed(target, home, domain):
    """Records of a domain's bootstrap file, keyed by prompt id, timestamps dropped."""
    out = {}
    for _, rec in read_jsonl(bootstrap_file(home, domain, target.fingerprint)):
        d = rec.to_dict()
        d.pop("timestamp")
        out[rec.prompt_id] = d
    return out


def test_bootstrap_lands_records_resumes_and_is_deterministic(target, tmp_path):
    s1 = run_bootstrap(target, tmp_path / "a")
    assert s1["code"]["new"] == 6 and s1["math"]["new"] == 6 and s1["code"]["tokens"] == 30
    assert s1["code"]["train"] + s1["code"]["heldout"] == 6
    recs = landed(target, tmp_path / "a", "math")
    assert set(recs) == {p.prompt_id for p in dl.load_prompts("math", 6, 0)}
    for d in recs.values():
        assert d["source"] == "bootstrap" and d["drafter"] is None and d["rounds"] == []
        assert len(d["completion_ids"]) == 5 and d["finish_reason"] == "length"
        assert d["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 5}
    s2 = run_bootstrap(target, tmp_path / "a")                  # second run adds nothing
    assert s2["code"]["new"] == 0 and s2["code"]["skipped"] == 6 and s2["math"]["tokens"] == 0
    assert len(list(read_jsonl(bootstrap_file(tmp_path / "a", "code", target.fingerprint)))) == 6
    run_bootstrap(target, tmp_path / "b", batch_size=1)         # same seed, other batching, other home
    assert landed(target, tmp_path / "b", "code") == landed(target, tmp_path / "a", "code")
    run_bootstrap(target, tmp_path / "c", seed=1, domains=["code"])
    assert landed(target, tmp_path / "c", "code") != landed(target, tmp_path / "a", "code")


def test_bootstrap_resumes_after_a_crash(target, tmp_path):
    run_bootstrap(target, tmp_path / "full", domains=["math"])
    full = bootstrap_file(tmp_path / "full", "math", target.fingerprint)
    lines = full.read_text().splitlines(keepends=True)
    crashed = bootstrap_file(tmp_path / "crash", "math", target.fingerprint)
    crashed.parent.mkdir(parents=True)
    crashed.write_text("".join(lines[:2]) + lines[2][:40])     # two records and a torn third write
    s = run_bootstrap(target, tmp_path / "crash", domains=["math"])
    assert s["math"]["new"] == 4 and s["math"]["skipped"] == 2
    assert landed(target, tmp_path / "crash", "math") == landed(target, tmp_path / "full", "math")
    # growing the run only generates the new prompts, and keeps earlier split assignments
    before = load_split(tmp_path / "crash", "math")["assignments"]
    s = run_bootstrap(target, tmp_path / "crash", domains=["math"], per_domain=9, heldout_fraction=0.9)
    assert s["math"]["new"] == 3
    after = load_split(tmp_path / "crash", "math")
    assert after["heldout_fraction"] == 0.3 and all(after["assignments"][k] == v for k, v in before.items())


def test_resume_with_other_length_is_refused(target, tmp_path):
    run_bootstrap(target, tmp_path, domains=["code"], per_domain=2)
    with pytest.raises(TraceFormatError, match="field 'sampling'"):
        run_bootstrap(target, tmp_path, domains=["code"], per_domain=3, max_new_tokens=7)


def test_greedy_completions_land_beside_the_sampled_ones(target, tmp_path):
    """Another sampling setting has its own landing file: greedy completions of the training prompts
    (train_only) join the sampled ones, held-out prompts get none, and resuming adds nothing."""
    run_bootstrap(target, tmp_path, domains=["code"], per_domain=8, heldout_fraction=0.4, samples_per_prompt=2)
    s = run_bootstrap(target, tmp_path, domains=["code"], per_domain=8, heldout_fraction=0.4, samples_per_prompt=2,
                      sampling={"temperature": 0.0}, train_only=True)
    split = load_split(tmp_path, "code")["assignments"]
    n_train = sum(v == "train" for v in split.values())
    assert 0 < n_train < 8 and s["code"]["new"] == n_train          # one greedy completion per training prompt
    greedy_file = bootstrap_file(tmp_path, "code", target.fingerprint, {"temperature": 0.0})
    assert greedy_file.name.endswith("-greedy.jsonl") and greedy_file != bootstrap_file(tmp_path, "code",
                                                                                        target.fingerprint)
    greedy = [rec for _, rec in read_jsonl(greedy_file)]
    assert all(split[r.prompt_id] == "train" and r.sampling["temperature"] == 0.0 for r in greedy)
    assert all("-greedy-" in r.request_id for r in greedy)
    # greedy is the argmax path: the same as a plain greedy decode of the prompt
    from dspark_core.engine.decode_one import generate
    from dspark_core.engine.sampling import SamplingParams
    for r in greedy[:2]:
        ref = generate(target.runner, list(r.prompt_ids), SamplingParams(max_new_tokens=5,
                                                                         stop_token_ids=target.stop_token_ids))
        assert list(r.completion_ids) == ref.token_ids
    train = training_records(tmp_path, "code", "train")
    assert len(train) == 3 * n_train and len(training_records(tmp_path, "code", "heldout")) == 8 - n_train
    again = run_bootstrap(target, tmp_path, domains=["code"], per_domain=8, heldout_fraction=0.4,
                          sampling={"temperature": 0.0}, train_only=True)
    assert again["code"]["new"] == 0
    other = run_bootstrap(target, tmp_path, domains=["code"], per_domain=2, sampling={"temperature": 1.0})
    assert other["code"]["file"].endswith("-t1-p0.9-k0.jsonl") and other["code"]["new"] == 2


def test_heldout_prompts_never_reach_training(target, tmp_path):
    run_bootstrap(target, tmp_path, domains=["math"], per_domain=12, heldout_fraction=0.5)
    split = load_split(tmp_path, "math")["assignments"]
    held = {k for k, v in split.items() if v == "heldout"}
    assert 0 < len(held) < 12
    train = training_records(tmp_path, "math", "train")
    heldout = training_records(tmp_path, "math", "heldout")
    assert not {r.prompt_id for r in train} & held
    assert {r.prompt_id for r in heldout} == held and len(train) + len(heldout) == 12
    # new serving traffic: an unsplit prompt is assigned by the recorded rule and recorded; a held-out
    # prompt sent again (same text, same id) stays held out
    held_id = next(iter(held))
    new_ids = [prompt_id_of(f"never split {i}") for i in range(20)]
    stray = [make_record(domain="math", prompt_id=i, request_id=f"s-{i}") for i in new_ids + [held_id]]
    write_jsonl(stray, landing_dir(tmp_path) / "math" / "serving-1.jsonl")
    train2 = training_records(tmp_path, "math", "train")
    recorded = load_split(tmp_path, "math")["assignments"]
    expected = {i for i in new_ids if dl.split_of(i, 0.5, 0) == "train"}
    assert 0 < len(expected) < 20
    assert {r.prompt_id for r in train2} == {r.prompt_id for r in train} | expected
    assert all(recorded[i] == dl.split_of(i, 0.5, 0) for i in new_ids) and recorded[held_id] == "heldout"
    assert held_id in {r.prompt_id for r in training_records(tmp_path, "math", "heldout")}
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        training_records(tmp_path, "math", "test")
    with pytest.raises(FileNotFoundError, match="dspark traces bootstrap"):
        load_split(tmp_path, "code")
    assert json.loads(split_file(tmp_path, "math").read_text())["seed"] == 0


def test_several_samples_per_training_prompt(target, tmp_path):
    """Scarce prompts: each training prompt gets several sampled completions (own generator, own
    request id), held-out prompts keep one, growing the count only adds samples, and every sample of
    a training prompt stays on the training side."""
    run_bootstrap(target, tmp_path / "one", domains=["code"], per_domain=8, heldout_fraction=0.4)
    s = run_bootstrap(target, tmp_path / "one", domains=["code"], per_domain=8, heldout_fraction=0.4,
                      samples_per_prompt=3)
    split = load_split(tmp_path / "one", "code")["assignments"]
    n_train = sum(v == "train" for v in split.values())
    assert 0 < n_train < 8 and s["code"]["new"] == 2 * n_train and s["code"]["skipped"] == 8
    recs = [rec for _, rec in read_jsonl(bootstrap_file(tmp_path / "one", "code", target.fingerprint))]
    assert len({r.request_id for r in recs}) == len(recs) == 8 + 2 * n_train
    per_prompt = {}
    for r in recs:
        per_prompt.setdefault(r.prompt_id, []).append(tuple(r.completion_ids))
    for pid, comps in per_prompt.items():
        assert len(comps) == (3 if split[pid] == "train" else 1)
        assert len(set(comps)) == len(comps)                   # different draws, not copies
    train = training_records(tmp_path / "one", "code", "train")
    assert len(train) == 3 * n_train and all(split[r.prompt_id] == "train" for r in train)
    assert len(training_records(tmp_path / "one", "code", "heldout")) == 8 - n_train
    # the first sample of each prompt is the one a single-sample run draws
    run_bootstrap(target, tmp_path / "two", domains=["code"], per_domain=8, heldout_fraction=0.4)
    first = landed(target, tmp_path / "two", "code")
    again = {r.prompt_id: r.completion_ids for r in recs if not r.request_id.rsplit("-", 1)[-1].startswith("s")}
    assert {k: v["completion_ids"] for k, v in first.items()} == again
    assert run_bootstrap(target, tmp_path / "one", domains=["code"], per_domain=8, heldout_fraction=0.4,
                         samples_per_prompt=3)["code"]["new"] == 0
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        run_bootstrap(target, tmp_path, samples_per_prompt=0)


def test_bootstrap_rejects_bad_arguments(target, tmp_path):
    with pytest.raises(ValueError, match="domain 'poetry' has no built-in prompts"):
        run_bootstrap(target, tmp_path, domains=["poetry"])
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        run_bootstrap(target, tmp_path, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="no tokenizer"):
        run_bootstrap(target, tmp_path, encode=None)


def test_cli_rejects_unknown_domain_before_loading_a_target(capsys, tmp_path, monkeypatch):
    from dspark_core.cli.main import main
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["traces", "bootstrap", "--domains", "code,poetry"]) == 2
    err = capsys.readouterr().err
    assert "domain 'poetry' has no built-in prompts" in err and "--prompts FILE, or choose from chat,code,math" in err


def test_heldout_records_come_in_one_order_whatever_order_they_were_written_in(target, tmp_path):
    run_bootstrap(target, tmp_path, domains=["math"], per_domain=12, heldout_fraction=0.5)
    held = heldout_records(tmp_path, "math")
    assert len(held) >= 2 and {r.prompt_id for r in held} == {r.prompt_id for r in
                                                              training_records(tmp_path, "math", "heldout")}
    assert [r.prompt_id for r in held] == sorted(r.prompt_id for r in held)
    path = bootstrap_file(tmp_path, "math", target.fingerprint)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(reversed(lines)) + "\n")          # batched generation finishing in another order
    assert [r.request_id for r in heldout_records(tmp_path, "math")] == [r.request_id for r in held]


# ------------------------------------------------------------------------------- mined code prompts
SOURCE = '''"""A module."""
import os


def parse_pairs(text, sep="="):
    """Split ``text`` into lines and each line into a key and a value at the first ``sep``;
    blank lines are skipped."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            key, _, value = line.partition(sep)
            out[key.strip()] = value.strip()
    return out


def _private(x):
    """A private helper that is long enough to qualify otherwise."""
    a = x
    b = a
    return b


def short(x):
    """Documented, but its body is a single statement."""
    return x


def undocumented(x):
    a = x
    b = a
    return b


class Box:
    def method(self):
        """Methods are not top-level functions and are left out."""
        a = 1
        b = a
        return b


async def fetch_all(urls,
                    limit=4):
    """Fetch every url with at most ``limit`` requests in flight and return the bodies in order."""
    sem = limit
    out = []
    return out
'''


def test_source_code_prompts_mine_public_documented_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "pkg" / "broken.py").write_text("def oops(:\n    pass\n")      # skipped, not fatal
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(SOURCE.replace("parse_pairs", "in_a_test_folder"))
    got = dl.source_code_prompts(tmp_path)
    assert len(got) == 2
    assert all(t.startswith("Complete the following Python function:\n\n```python\n") and t.endswith("```")
               for t in got)
    first, second = got
    # the def line and the docstring, nothing of the body: the target writes it
    assert 'def parse_pairs(text, sep="="):\n    """Split ``text``' in first and "blank lines are skipped.\"\"\"\n```" in first
    assert "out = {}" not in first
    assert "async def fetch_all(urls,\n                    limit=4):" in second and "sem = limit" not in second
    # the same stub shape as HumanEval's prompts, which is what the code domain is evaluated on
    assert dl.humaneval_prompts()[0].startswith(dl.CODE_INSTRUCTION.split("{")[0])
    # load_prompts: seeded order, prefix-stable, code only, a clear error for a missing folder
    mined = dl.load_prompts("code", 5, seed=0, code_from=str(tmp_path))
    assert {p.text for p in mined} == set(got) and all(p.domain == "code" for p in mined)
    with pytest.raises(ValueError, match="code_from is a source of the code domain"):
        dl.load_prompts("math", 3, 0, code_from=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        dl.load_prompts("code", 3, 0, code_from=str(tmp_path / "missing"))


def test_stdlib_is_a_code_source_of_hundreds_of_prompts():
    got = dl.load_prompts("code", 300, seed=0, code_from="stdlib")
    assert len(got) == 300 and len({p.prompt_id for p in got}) == 300
    assert got[:50] == dl.load_prompts("code", 50, seed=0, code_from="stdlib")
    humaneval = {p.prompt_id for p in dl.load_prompts("code", 500, seed=0)}
    assert not humaneval & {p.prompt_id for p in got}


def test_mined_code_prompts_only_ever_train(target, tmp_path):
    """Prompts mined from source are extra training data: the run is train-only whatever the caller
    asks, so the code domain's held-out set stays HumanEval's (what evaluation measures)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i}.py").write_text(SOURCE.replace("parse_pairs", f"parse_pairs_{i}")
                                      .replace("fetch_all", f"fetch_all_{i}"))
    home = tmp_path / "home"
    run_bootstrap(target, home, domains=["code"], per_domain=8, heldout_fraction=0.4)
    held_before = {r.request_id for r in heldout_records(home, "code")}
    s = run_bootstrap(target, home, domains=["code"], per_domain=24, heldout_fraction=0.4, code_from=str(src),
                      sampling={"temperature": 0.0})
    split = load_split(home, "code")["assignments"]
    mined = dl.load_prompts("code", 24, 0, code_from=str(src))
    n_train = sum(split[p.prompt_id] == "train" for p in mined)
    assert 0 < n_train < 24 and s["code"]["new"] == n_train
    assert {r.request_id for r in heldout_records(home, "code")} == held_before
    train_ids = {r.prompt_id for r in training_records(home, "code", "train")}
    assert {p.prompt_id for p in mined if split[p.prompt_id] == "train"} <= train_ids
    with pytest.raises(ValueError, match="code domain only"):
        run_bootstrap(target, home, domains=["code", "math"], code_from=str(src))


def test_cli_code_from_errors_name_the_fix(capsys, tmp_path, monkeypatch):
    from dspark_core.cli.main import main
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["traces", "bootstrap", "--domains", "chat", "--code-from", "stdlib"]) == 2
    assert "hint: add --domains code" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domains", "code", "--code-from", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "hint: --code-from stdlib" in err

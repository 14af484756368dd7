"""Prompt sources beyond the built-in three: the domain classifier, routed ShareGPT turns, users' prompt
files for any domain, and chat logs landed as traces."""

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from dspark_core.cli.main import main
from dspark_core.data import prompts as dl
from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces, load_split, source_prompts
from dspark_core.data.chatlogs import import_chat_logs
from dspark_core.data.classify import classify_prompt
from dspark_core.data.traces import landing_dir, prompt_id_of, read_jsonl
from dspark_core.engine.inputs import encode_messages
from tiny_models import tiny_target

HERE = Path(__file__).parent
VOCAB = 64


# ------------------------------------------------------------------------------------------ classifier
def test_classifier_on_labelled_prompts():
    rows = [json.loads(line) for line in (HERE / "labelled_prompts.jsonl").read_text().splitlines()]
    assert Counter(r["label"] for r in rows) == {"code": 52, "math": 52, "chat": 52}
    pred = [classify_prompt(r["text"]) for r in rows]
    assert sum(p == r["label"] for p, r in zip(pred, rows)) / len(rows) >= 0.95
    for domain in ("code", "math"):        # routed training data: what lands in a domain must belong there
        chosen = [r["label"] for p, r in zip(pred, rows) if p == domain]
        assert sum(lab == domain for lab in chosen) / len(chosen) >= 0.95, domain
        recall = sum(p == domain for p, r in zip(pred, rows) if r["label"] == domain) / 52
        assert recall >= 0.9, domain


def test_classifier_on_the_builtin_sources():
    assert {classify_prompt(t) for t in dl.humaneval_prompts()} == {"code"}
    assert Counter(classify_prompt(t) for t in dl.math_problems(240, seed=3)) == {"math": 240}


# ------------------------------------------------------------------------------------------ ShareGPT
def _sharegpt_file(path: Path, convs: list[list[str]], torn: bool = True) -> Path:
    recs = [{"id": str(i), "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": t}
                                             for j, t in enumerate(turns)]} for i, turns in enumerate(convs)]
    text = json.dumps(recs)
    path.write_text(text[:-1] + ', {"id": "torn", "conversations": [{"from": "hu' if torn else text)
    return path


CONVS = [
    ["Write a poem about the sea and the wind.", "(a poem)", "Write a Python function that reverses a string.",
     "(code)", "ok", "(...)"],
    ["Solve for x: 3x + 7 = 22, show the steps.", "(steps)", "Now explain why the sky is blue to a child.", "(...)"],
    ["How do I read a CSV file with pandas in Python?", "(code)", "What is 15% of 240, calculated by hand?"],
]


def test_sharegpt_turns_are_routed_and_held_out_conversations_left_out(tmp_path):
    path = _sharegpt_file(tmp_path / "sg.json", CONVS)
    turns = list(dl.sharegpt_human_turns(path))
    firsts = [prompt_id_of(c[0]) for c in CONVS]
    # every human turn of 16+ characters, keyed by its conversation's first turn ("ok" is too short)
    assert turns == [(firsts[0], CONVS[0][0]), (firsts[0], CONVS[0][2]), (firsts[1], CONVS[1][0]),
                     (firsts[1], CONVS[1][2]), (firsts[2], CONVS[2][0]), (firsts[2], CONVS[2][2])]
    assert dl.sharegpt_routed_prompts("code", path=path) == [CONVS[0][2], CONVS[2][0]]
    assert dl.sharegpt_routed_prompts("math", path=path) == [CONVS[1][0], CONVS[2][2]]
    assert dl.sharegpt_routed_prompts("chat", path=path) == [CONVS[0][0], CONVS[1][2]]
    held = {firsts[2]}
    assert dl.sharegpt_routed_prompts("math", held.__contains__, path=path) == [CONVS[1][0]]
    with pytest.raises(ValueError, match="routed to chat, code, math"):
        dl.sharegpt_routed_prompts("support", path=path)


def test_sharegpt_bootstrap_trains_only_and_never_on_heldout_chat(tmp_path, monkeypatch):
    convs = [[f"Write a Python function number {i} that parses a JSON config file.", "(code)",
              f"Now write unit tests for function number {i} in pytest."] for i in range(40)]
    monkeypatch.setattr(dl, "sharegpt_path", lambda: _sharegpt_file(tmp_path / "sg.json", convs))
    target = tiny_target(vocab=VOCAB, layers=2)
    home = tmp_path / "home"
    cfg = BootstrapConfig(("code",), per_domain=None, seed=0, batch_size=4, max_new_tokens=3,
                          heldout_fraction=0.3, from_sharegpt=True)
    enc = lambda t: [1 + b % (VOCAB - 1) for b in hashlib.sha1(t.encode()).digest()[:4]]  # noqa: E731
    summary = bootstrap_traces(target, home, cfg, encode=enc, progress=False)["code"]
    chat_held = {prompt_id_of(c[0]) for c in convs if dl.split_of(prompt_id_of(c[0]), 0.3, 0) == "heldout"}
    assert 3 <= len(chat_held) <= 25
    allowed = {prompt_id_of(t) for c in convs if prompt_id_of(c[0]) not in chat_held for t in (c[0], c[2])}
    recs = [r for f in (landing_dir(home) / "code").glob("*.jsonl") for _, r in read_jsonl(f)]
    split = load_split(home, "code")["assignments"]
    assert recs and summary["new"] == len(recs)
    assert {r.prompt_id for r in recs} <= allowed                       # no turn of a held-out conversation
    assert {split[r.prompt_id] for r in recs} == {"train"}              # training-only
    # the chat domain's recorded split decides when there is one
    from dspark_core.data.bootstrap import heldout_conversation_rule, record_split
    record_split(home, "chat", [dl.Prompt("chat", prompt_id_of(c[0]), c[0]) for c in convs], 0.5, 9)
    rule = heldout_conversation_rule(home, seed=0, heldout_fraction=0.3)
    recorded = load_split(home, "chat")["assignments"]
    assert all(rule(pid) == (recorded[pid] == "heldout") for pid in recorded)


def test_sharegpt_heldout_conversations_land_as_heldout_and_never_train(tmp_path, monkeypatch):
    convs = [[f"Write a Python function number {i} that parses a JSON config file.", "(code)",
              f"Now write unit tests for function number {i} in pytest."] for i in range(40)]
    shared = "Write a Python class that caches HTTP responses on disk."       # in a kept and a held-out conversation
    convs += [[f"Tell me about the history of the town number {i}, please.", "(...)", shared] for i in range(6)]
    monkeypatch.setattr(dl, "sharegpt_path", lambda: _sharegpt_file(tmp_path / "sg.json", convs))
    target = tiny_target(vocab=VOCAB, layers=2)
    home = tmp_path / "home"
    enc = lambda t: [1 + b % (VOCAB - 1) for b in hashlib.sha1(t.encode()).digest()[:4]]  # noqa: E731
    base = dict(per_domain=None, seed=0, batch_size=4, max_new_tokens=3, heldout_fraction=0.3, from_sharegpt=True)
    trained = bootstrap_traces(target, home, BootstrapConfig(("code",), **base), encode=enc, progress=False)["code"]
    held = bootstrap_traces(target, home, BootstrapConfig(("code",), heldout_only=True, **base), encode=enc,
                            progress=False)["code"]
    chat_held = {prompt_id_of(c[0]) for c in convs if dl.split_of(prompt_id_of(c[0]), 0.3, 0) == "heldout"}
    assert 3 <= len(chat_held) <= 30
    assert any(prompt_id_of(c[0]) in chat_held for c in convs[40:]) and any(
        prompt_id_of(c[0]) not in chat_held for c in convs[40:])               # the shared text is on both sides
    expected = {prompt_id_of(c[2]) for c in convs[:40] if prompt_id_of(c[0]) in chat_held} | \
        {prompt_id_of(c[0]) for c in convs[:40] if prompt_id_of(c[0]) in chat_held}
    recs = [r for f in (landing_dir(home) / "code").glob("*.jsonl") for _, r in read_jsonl(f)]
    split = load_split(home, "code")["assignments"]
    held_ids = {r.prompt_id for r in recs if split[r.prompt_id] == "heldout"}
    train_ids = {r.prompt_id for r in recs if split[r.prompt_id] == "train"}
    assert held["new"] == held["heldout"] == len(expected) and held["train"] == 0
    assert held_ids == expected                                 # every routed turn of a held-out conversation ...
    assert prompt_id_of(shared) not in held_ids                 # ... but a text a kept conversation also has
    assert trained["new"] == len(train_ids) and not held_ids & train_ids
    assert len({r.request_id for r in recs}) == len(recs)       # one completion per held-out prompt
    from dspark_core.data.bootstrap import heldout_records, training_records
    assert {r.prompt_id for r in heldout_records(home, "code")} == held_ids
    assert not {r.prompt_id for r in training_records(home, "code", "train")} & held_ids
    again = bootstrap_traces(target, home, BootstrapConfig(("code",), heldout_only=True, **base), encode=enc,
                             progress=False)["code"]
    assert again["new"] == 0 and again["skipped"] == len(expected)
    with pytest.raises(ValueError, match="needs from_sharegpt"):
        BootstrapConfig(("code",), heldout_only=True)
    with pytest.raises(ValueError, match="exclude each other"):
        BootstrapConfig(("code",), heldout_only=True, from_sharegpt=True, train_only=True)


def test_sharegpt_routing_of_the_packaged_file():
    counts = Counter(classify_prompt(t) for _, t in dl.sharegpt_human_turns())
    total = sum(counts.values())
    assert total > 40_000                                               # every human turn, not only the first
    assert counts["chat"] > counts["code"] > counts["math"] > 500


# ------------------------------------------------------------------------------------------ prompt files
def _write_lines(path: Path, rows: list) -> Path:
    """JSON lines of ``rows``; a row ``"{bad json"`` or ``""`` is written as is (a broken or blank line)."""
    raw = ("{bad json", "")
    path.write_text("\n".join(r if r in raw else json.dumps(r) for r in rows) + "\n")
    return path


def test_prompt_file_formats_and_rejects(tmp_path):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": "A helper."}, {"role": "user", "content": "Tell me a joke."}]
    path = _write_lines(tmp_path / "p.jsonl", [
        "Where is my order 123?",
        {"prompt": "Cancel my subscription, please."},
        {"messages": conv},
        {"conversations": [{"from": "human", "value": "Reset my password."}, {"from": "gpt", "value": "Done."}]},
        "{bad json",
        {"messages": [{"role": "robot", "content": "x"}]},
        {"prompt": 7},
        {"other": "field"},
        {"text": "Where is my order 123?"},                         # a duplicate: kept once
        "",
    ])
    prompts, rejected = dl.read_prompt_file(path, "support")
    texts = [p.text for p in prompts]
    assert texts[:2] == ["Where is my order 123?", "Cancel my subscription, please."]
    # a conversation gives one prompt per user turn, with the context before it; keyed as the server keys it
    assert texts[2] == dl.chat_prompt_text(conv[:2]) and texts[3] == dl.chat_prompt_text(conv)
    assert prompts[3].chat_messages() == conv and prompts[3].prompt_id == prompt_id_of(json.dumps(conv, ensure_ascii=False))
    assert texts[4] == "Reset my password." and prompts[4].messages is None
    assert len(prompts) == 5 and {p.domain for p in prompts} == {"support"}
    reasons = dict(rejected)
    assert sorted(reasons) == [5, 6, 7, 8]
    assert "not JSON" in reasons[5] and "unknown role 'robot'" in reasons[6]
    assert "prompt: must be a string" in reasons[7] and "no 'prompt', 'text', 'messages'" in reasons[8]
    (tmp_path / "empty.jsonl").write_text("{bad\n")
    with pytest.raises(dl.PromptFileError, match="no usable prompt in 1 record"):
        dl.read_prompt_file(tmp_path / "empty.jsonl", "support")
    with pytest.raises(dl.PromptFileError, match="no such prompt file"):
        dl.read_prompt_file(tmp_path / "missing.jsonl", "support")


def test_prompt_file_as_a_torn_json_array(tmp_path):
    path = _sharegpt_file(tmp_path / "dump.json", CONVS)
    prompts, rejected = dl.read_prompt_file(path, "mixed")
    assert not rejected
    assert [p.chat_messages()[-1]["content"] for p in prompts] == [CONVS[0][0], CONVS[0][2], "ok", CONVS[1][0],
                                                                   CONVS[1][2], CONVS[2][0], CONVS[2][2]]


def test_bootstrap_of_a_new_domain_from_a_prompt_file(tmp_path):
    target = tiny_target(vocab=VOCAB, layers=2)
    path = _write_lines(tmp_path / "support.jsonl", [f"Question {i} about my invoice" for i in range(30)]
                        + [{"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                                         {"role": "user", "content": "Refund?"}]}])
    enc = lambda t: [1 + b % (VOCAB - 1) for b in hashlib.sha1(t.encode()).digest()[:4]]  # noqa: E731
    home = tmp_path / "home"
    cfg = BootstrapConfig(("support",), per_domain=None, batch_size=8, max_new_tokens=3, heldout_fraction=0.2,
                          prompts_file=str(path))
    s = bootstrap_traces(target, home, cfg, encode=enc, progress=False)["support"]
    assert s["prompts"] == 32 and s["new"] == 32 and s["train"] + s["heldout"] == 32 and s["heldout"] >= 1
    recs = [r for _, r in read_jsonl(Path(s["file"]))]
    assert {r.domain for r in recs} == {"support"} and len(recs) == 32
    assert bootstrap_traces(target, home, cfg, encode=enc, progress=False)["support"]["new"] == 0   # resumable
    assert [p.text for p in source_prompts(home, "support", BootstrapConfig(("support",), per_domain=3,
                                                                            prompts_file=str(path)))] == \
        ["Question 0 about my invoice", "Question 1 about my invoice", "Question 2 about my invoice"]
    with pytest.raises(ValueError, match="no built-in prompts"):
        BootstrapConfig(("support",))
    with pytest.raises(ValueError, match="one prompt source"):
        BootstrapConfig(("code",), code_from="stdlib", from_sharegpt=True)
    with pytest.raises(ValueError, match="routed to chat, code, math only"):
        BootstrapConfig(("support",), from_sharegpt=True)


def test_cli_refuses_unknown_domains_and_sources(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert main(["traces", "bootstrap", "--domain", "support"]) == 2
    assert "--prompts FILE" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domain", "Bad Name", "--prompts", "x"]) == 2
    assert "[a-z0-9_-]" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domain", "support", "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domains", "code", "--from-sharegpt", "--code-from", "stdlib"]) == 2
    assert "one prompt source" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domains", "code", "--heldout"]) == 2
    assert "hint: add --from-sharegpt" in capsys.readouterr().err
    assert main(["traces", "bootstrap", "--domains", "code", "--from-sharegpt", "--heldout", "--train-only"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["traces", "import", str(tmp_path / "none.jsonl"), "--domain", "support"]) == 2
    assert "no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ chat logs
def test_import_chat_logs_on_smollm2(smollm2, tmp_path):
    tok = smollm2.tokenizer
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}]
    log = _write_lines(tmp_path / "logs.jsonl", [
        {"messages": conv},
        {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"},
                           {"from": "human", "value": "Say bye."}, {"from": "gpt", "value": "Bye!"}]},
        {"prompt": "Count to three.", "completion": "One, two, three."},
        {"messages": conv[:1]},                                        # no reply
        {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "?"}]},
        "{bad json",
    ])
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 256}
    s = import_chat_logs(smollm2, tmp_path / "home", log, "support", sampling, heldout_fraction=0.0)
    assert (s["records"], s["new"], s["skipped"], s["rejected"]) == (6, 3, 0, 3)
    reasons = dict(s["rejects"])
    assert "not the model's reply" in reasons[4] and "no non-empty user message" in reasons[5]
    assert "not JSON" in reasons[6]
    recs = {r.prompt_id: r for _, r in read_jsonl(Path(s["file"]))}
    first = recs[prompt_id_of(conv[0]["content"])]
    assert first.source == "import" and first.target_fingerprint == smollm2.fingerprint
    assert first.prompt_ids == encode_messages(tok, conv[:1])
    # the reply's tokens as the template renders an assistant turn, up to the end-of-turn token
    assert tok.decode(first.completion_ids[:-1]) == "The capital of France is Paris."
    assert first.completion_ids[-1] in smollm2.stop_token_ids and first.finish_reason == "stop"
    multi = [r for r in recs.values() if len(r.prompt_ids) > len(first.prompt_ids) and "Bye" in tok.decode(r.completion_ids)]
    assert len(multi) == 1 and "Say hi." in tok.decode(multi[0].prompt_ids)
    again = import_chat_logs(smollm2, tmp_path / "home", log, "support", sampling)
    assert (again["new"], again["skipped"]) == (0, 3)                  # idempotent
    assert load_split(tmp_path / "home", "support")["assignments"].keys() == recs.keys()

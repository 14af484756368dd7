"""Land existing chat logs as trace records, so a domain has training data before traffic reaches dspark.

A platform that already serves the target keeps logs of its conversations: OpenAI chat ``messages`` whose
last message is the model's reply, ShareGPT ``conversations`` ending in a ``gpt`` turn, or
``{"prompt", "completion"}`` pairs (JSON lines, or one JSON array). :func:`import_chat_logs` turns each
into a :class:`~dspark_core.data.traces.TraceRecord` with ``source="import"``: the prompt is every
message before the last reply, run through the target's chat template; the completion is the reply's
tokens exactly as the template renders an assistant turn (end-of-turn token included when the template
has one). No target runs: the logged reply *is* the target's output, which is why the caller names the
target that wrote it (its fingerprint goes in every record) and the sampling it was served with.

Records land in ``<home>/landing/<domain>/import-<fingerprint[:12]>.jsonl`` with request id
``import-<hash of the conversation>``, so importing the same log twice adds nothing; the domain's
train / held-out split records every imported prompt. A record that cannot be used (no reply, an empty
prompt, a template that does not render) is reported with its reason and skipped; the rest land.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from dspark_core.data.prompts import (Prompt, PromptFileError, conversations_of, iter_prompt_file, prompt_of)
from dspark_core.data.traces import TraceRecord, landing_file, read_jsonl, repair_torn_tail, utc_now_iso, write_jsonl
from dspark_core.engine.inputs import encode_messages


def _exchange(record, where: str) -> tuple[list[dict], str]:
    """``(prompt messages, reply)`` of one log record: its last message must be the assistant's reply,
    with a non-empty user message before it."""
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        if not isinstance(record["completion"], str):
            raise ValueError(f"{where}.completion: must be a string, got {type(record['completion']).__name__}")
        messages = conversations_of({"prompt": record["prompt"]}, where)[0]
        messages.append({"role": "assistant", "content": record["completion"]})
    else:
        messages = conversations_of(record, where)[0]
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message is not the model's reply (role {messages[-1]['role']!r})")
    if not messages[-1]["content"].strip():
        raise ValueError(f"{where}: the model's reply is empty")
    prompt = messages[:-1]
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        raise ValueError(f"{where}: no non-empty user message before the reply")
    return prompt, messages[-1]["content"]


def reply_ids(tokenizer, prompt: list[dict], reply: str, prompt_ids: list[int]) -> list[int]:
    """The token ids the chat template renders for ``reply`` after ``prompt``: the full conversation's
    ids minus the prompt's (with its generation prompt). Raises ValueError when the template does not
    extend the prompt that way (a template that rewrites earlier turns)."""
    full = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": reply}], tokenize=True,
                                         add_generation_prompt=False)
    if isinstance(full, dict) or hasattr(full, "input_ids"):
        full = full["input_ids"]
    full = list(full)
    if full[:len(prompt_ids)] != prompt_ids or len(full) == len(prompt_ids):
        raise ValueError("the chat template does not render the reply as a continuation of the prompt")
    return full[len(prompt_ids):]


def _cut_at_stop(ids: list[int], stop_ids: tuple[int, ...]) -> tuple[list[int], str]:
    """The reply up to and including its first stop token (what the target emitted), and the finish
    reason: ``stop`` when one is there, ``length`` otherwise."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i + 1], "stop"
    return ids, "length"


def import_chat_logs(target, home: Path, path: Path, domain: str, sampling: dict, heldout_fraction: float = 0.1,
                     seed: int = 0, log: Callable[[str], None] = lambda _: None) -> dict:
    """Land the exchanges of a chat-log file as ``domain`` traces of ``target``; returns a summary:
    records, new, skipped (already landed), rejected (count), rejects (first ten ``(record, reason)``),
    tokens (completion tokens landed), train, heldout (of this file's prompts), file.

    ``sampling`` = ``{"temperature", "top_p", "top_k", "max_new_tokens"}`` the logged replies were served
    with (``max_new_tokens`` is raised per record to the reply's length where it is shorter)."""
    from dspark_core.data.bootstrap import record_split
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("importing chat logs needs the target's tokenizer with a chat template")
    out = landing_file(home, domain, f"import-{target.fingerprint[:12]}")
    done = set()
    if out.exists():
        repair_torn_tail(out)
        done = {rec.request_id for _, rec in read_jsonl(out)}
    records, new, skipped, tokens = 0, [], 0, 0
    rejects: list[tuple[int, str]] = []
    prompts: dict[str, Prompt] = {}
    for n, record in iter_prompt_file(path):
        records += 1
        try:
            if isinstance(record, ValueError):
                raise ValueError(f"record {n}: {record}")
            prompt_msgs, reply = _exchange(record, f"record {n}")
            rid = "import-" + hashlib.sha1(json.dumps([prompt_msgs, reply], ensure_ascii=False,
                                                      sort_keys=True).encode("utf-8")).hexdigest()[:20]
            p = prompt_of(domain, prompt_msgs)
            if rid in done:
                skipped += 1
                prompts.setdefault(p.prompt_id, p)
                continue
            prompt_ids = encode_messages(tokenizer, prompt_msgs)
            completion, finish = _cut_at_stop(reply_ids(tokenizer, prompt_msgs, reply, prompt_ids),
                                              tuple(target.stop_token_ids))
            rec = TraceRecord(
                request_id=rid, timestamp=utc_now_iso(), domain=domain, prompt_id=p.prompt_id,
                prompt_ids=prompt_ids, completion_ids=completion,
                sampling={**sampling, "max_new_tokens": max(int(sampling["max_new_tokens"]), len(completion))},
                target_fingerprint=target.fingerprint, drafter=None, rounds=[], source="import",
                finish_reason=finish)
        except (ValueError, TypeError) as exc:
            rejects.append((n, str(exc)))
            continue
        done.add(rid)
        new.append(rec)
        tokens += len(completion)
        prompts.setdefault(p.prompt_id, p)
        if len(new) >= 256:             # land as we go: an interrupted import keeps what it read
            write_jsonl(new, out)
            new.clear()
    if new:
        write_jsonl(new, out)
    landed = records - skipped - len(rejects)
    if not prompts:
        first = f"; first problem: {rejects[0][1]}" if rejects else ""
        raise PromptFileError(f"{path}: no usable exchange in {records} record(s){first}")
    split = record_split(home, domain, prompts.values(), heldout_fraction, seed, log)["assignments"]
    held = sum(split[pid] == "heldout" for pid in prompts)
    for n, reason in rejects[:5]:
        log(f"{path}: skipped {reason}")
    return {"records": records, "new": landed, "skipped": skipped, "rejected": len(rejects),
            "rejects": rejects[:10], "tokens": tokens, "train": len(prompts) - held, "heldout": held,
            "file": str(out)}

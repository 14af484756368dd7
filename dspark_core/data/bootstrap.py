"""Bootstrap traces: run the frozen target on offline prompts and land the results as trace records.

Before any production traffic exists, drafters train on the target's own completions of real prompts
(ShareGPT chat, HumanEval code, generated math; see :mod:`dspark_core.data.prompts`). This module
turns those prompts into :class:`~dspark_core.data.traces.TraceRecord` files and fixes the prompt-level
train / held-out split:

- traces: ``<home>/landing/<domain>/bootstrap-<fingerprint[:12]>.jsonl``, one record per prompt
  (``source="bootstrap"``, ``drafter=None``, ``rounds=[]``), appended as each prompt finishes, so a crash
  loses at most the prompts in flight;
- split: ``<home>/splits/<domain>.json`` = ``{"seed", "heldout_fraction", "assignments": {prompt_id:
  "train" | "heldout"}}``; merged, never rewritten: an assignment once recorded never changes.

``samples_per_prompt`` > 1 draws that many completions of each *training* prompt (sample ``j`` has its own
generator and request id ``...-s<j>``; held-out prompts keep one completion): more of the target's own
distribution per prompt where prompts are scarce (HumanEval has 164).

Each sampling setting lands in its own file (:func:`sampling_tag`): ``--temperature 0`` adds greedy
completions (``bootstrap-<fp>-greedy.jsonl``, request ids ``...-greedy-<prompt>``) next to the sampled
ones; with ``train_only`` only training prompts get them (extra training data, nothing new held out).

ShareGPT human turns routed to a domain (``from_sharegpt``) are training data, from every conversation
but the held-out ones (those whose first turn is a held-out chat prompt); with ``heldout_only`` the routed
turns of those held-out conversations land instead, as the domain's held-out prompts, so a domain such as
code can be measured on many more prompts than its built-in held-out share.

Resumable: requests already in the landing file are skipped, so rerunning adds nothing and a run grown
with a larger ``per_domain`` only generates the new prompts. Deterministic: each prompt has its own
``torch.Generator`` seeded from ``(seed, prompt_id)``, so its completion does not depend on batching
or on which prompts were done before (up to bf16 rounding of batched matmuls).

Sampling defaults to what a server would use (:data:`SERVING_SAMPLING`: temperature 0.7, top-p 0.9,
top-k off, 256 new tokens), so drafters learn the distribution they will later face.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from dspark_core.data.features import FeatureCapture, FeatureStore
from dspark_core.data.prompts import (DOMAINS, Prompt, load_prompts, read_prompt_file, sharegpt_heldout_prompts,
                                      sharegpt_routed_prompts, split_of)
from dspark_core.data.traces import (TraceFormatError, TraceRecord, landing_dir, landing_file,
                                     is_domain_name, prompt_id_of, read_jsonl, repair_torn_tail, utc_now_iso,
                                     write_jsonl)
from dspark_core.engine.inputs import encode_messages, encode_prompt, make_generator
from dspark_core.engine.plain_batch import BatchRequest, BatchResult, generate_batch
from dspark_core.engine.sampling import SamplingParams

SERVING_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 32       # rows; `dspark bench --suite bootstrap` compares batch sizes
SPLITS = ("train", "heldout")


def sampling_tag(sampling: dict | None) -> str:
    """The landing-file tag of a sampling setting: ``""`` for the serving default, ``"greedy"`` for
    temperature 0, else ``t<T>-p<P>-k<K>``. Each setting lands in its own file, so one DSPARK_HOME can
    hold sampled and greedy completions of the same prompts side by side."""
    sp = {**SERVING_SAMPLING, **(sampling or {})}
    if float(sp["temperature"]) == 0.0:
        return "greedy"
    if all(sp[k] == SERVING_SAMPLING[k] for k in SERVING_SAMPLING):
        return ""
    return f"t{float(sp['temperature']):g}-p{float(sp['top_p']):g}-k{int(sp['top_k'])}"


def bootstrap_file(home: Path, domain: str, fingerprint: str, sampling: dict | None = None) -> Path:
    tag = sampling_tag(sampling)
    return landing_file(home, domain, f"bootstrap-{fingerprint[:12]}" + (f"-{tag}" if tag else ""))


def split_file(home: Path, domain: str) -> Path:
    return Path(home) / "splits" / f"{domain}.json"


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The generator seed of one prompt: a hash of (seed, prompt_id), independent of batching."""
    return int(hashlib.sha1(f"bootstrap:{seed}:{prompt_id}".encode()).hexdigest()[:15], 16)


# ----------------------------------------------------------------------------------------- splits
def load_split(home: Path, domain: str) -> dict:
    """The recorded split of ``domain``: ``{"seed", "heldout_fraction", "assignments"}``."""
    path = split_file(home, domain)
    if not path.exists():
        raise FileNotFoundError(f"no train/held-out split recorded for domain {domain!r} at {path}; "
                                f"run: dspark traces bootstrap --domains {domain}")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("assignments"), dict):
        raise ValueError(f"{path}: not a split file (expected an object with 'assignments')")
    bad = {k: v for k, v in data["assignments"].items() if v not in SPLITS}
    if bad:
        k = next(iter(bad))
        raise ValueError(f"{path}: prompt {k} has split {bad[k]!r}; expected 'train' or 'heldout'")
    return data


def record_split(home: Path, domain: str, prompts: Iterable[Prompt], heldout_fraction: float, seed: int,
                 log: Callable[[str], None] = lambda _: None, side: str | None = None) -> dict:
    """Add the prompts' assignments to the domain's split file and return the merged split.

    Existing assignments are kept as they are. When the file exists, new prompts are assigned with its
    recorded seed and fraction (not the arguments), so the whole file stays one hash rule; ``side``
    ("train" or "heldout") assigns every new prompt to that side instead (prompts held out by their source,
    such as the turns of held-out ShareGPT conversations).
    """
    if side is not None and side not in SPLITS:
        raise ValueError(f"side must be 'train' or 'heldout', got {side!r}")
    path = split_file(home, domain)
    if path.exists():
        data = load_split(home, domain)
        if (data["seed"], data["heldout_fraction"]) != (seed, heldout_fraction):
            log(f"{domain}: keeping the recorded split rule (seed {data['seed']}, heldout_fraction "
                f"{data['heldout_fraction']}) over the requested one (seed {seed}, {heldout_fraction})")
    else:
        data = {"seed": seed, "heldout_fraction": heldout_fraction, "assignments": {}}
    assignments = data["assignments"]
    added = 0
    for p in prompts:
        if p.prompt_id not in assignments:
            assignments[p.prompt_id] = side or split_of(p.prompt_id, data["heldout_fraction"], data["seed"])
            added += 1
    if added or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)   # atomic: a crash leaves the old or the new file, never half of one
    return data


def training_records(home: Path, domain: str, split: str, fingerprint: str | None = None) -> list[TraceRecord]:
    """All landing traces of ``domain`` whose prompt is in ``split`` (optionally of one target).

    A held-out prompt is never returned for ``"train"`` (and vice versa). A prompt with no recorded
    split yet (new serving traffic) is assigned by the domain's recorded hash rule and recorded, as the
    pipeline's snapshot does, so it lands on the same side whoever sees it first. Prompt ids are the
    hash of the prompt text (serving uses the single user message), so a held-out bootstrap prompt sent
    through the server keeps its id and its side. Malformed trace lines raise :class:`TraceFormatError`
    with file and line.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    folder = landing_dir(home) / domain
    records = []
    for path in sorted(folder.glob("*.jsonl")) if folder.exists() else ():
        records += [rec for _, rec in read_jsonl(path)
                    if fingerprint is None or rec.target_fingerprint == fingerprint]
    data = load_split(home, domain)
    if any(r.prompt_id not in data["assignments"] for r in records):
        data = record_split(home, domain, [r for r in records if r.prompt_id not in data["assignments"]],
                            data["heldout_fraction"], data["seed"])
    return [r for r in records if data["assignments"][r.prompt_id] == split]


def heldout_records(home: Path, domain: str, fingerprint: str | None = None) -> list[TraceRecord]:
    """The held-out traces of ``domain`` in a fixed order: by prompt id (a hash of the prompt text), then
    request id. Benchmarks take "the first n held-out prompts" from it, so their choice never depends on
    the order in which batched generation finished and wrote the traces (longest prompts first)."""
    return sorted(training_records(home, domain, "heldout", fingerprint), key=lambda r: (r.prompt_id, r.request_id))


# -------------------------------------------------------------------------------------- bootstrap
def _existing(path: Path, sampling: dict, log: Callable[[str], None]) -> set[str]:
    """Request ids already landed in ``path``, after cutting a torn last line left by a crash."""
    if not path.exists():
        return set()
    if repair_torn_tail(path):
        log(f"{path}: removed an unterminated last line (an interrupted write); that prompt is redone")
    done = set()
    for lineno, rec in read_jsonl(path):
        if rec.sampling != sampling:
            raise TraceFormatError(f"{path}:{lineno}: field 'sampling' is {rec.sampling}, but this run uses "
                                   f"{sampling}; resume with the same settings (a new --max-new-tokens "
                                   f"needs another DSPARK_HOME)")
        done.add(rec.request_id)
    return done


def sample_key(prompt_id: str, j: int) -> str:
    """The key of completion ``j`` of a prompt: the prompt id for the first, ``<id>-s<j>`` after."""
    return prompt_id if j == 0 else f"{prompt_id}-s{j}"


@dataclass(frozen=True)
class BootstrapConfig:
    """What a bootstrap run generates: which prompts, how many completions of each, how they are sampled."""

    domains: tuple[str, ...] = DOMAINS
    per_domain: int | None = 64                     # prompts per domain (None: all the source has)
    seed: int = 0                                   # prompt choice, split rule and every prompt's generator
    batch_size: int = DEFAULT_BATCH_SIZE            # rows generated together
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    heldout_fraction: float = 0.1                   # of a domain's prompts, for a new split file
    sampling: Mapping[str, float] | None = None     # overrides keys of SERVING_SAMPLING
    samples_per_prompt: int = 1                     # completions of each training prompt (sampled only)
    train_only: bool = False                        # skip held-out prompts (extra training data only)
    feature_taps: tuple[int, ...] | None = None     # also store the training sequences' target features
    code_from: str | None = None                    # "stdlib" or a path: code prompts mined from Python source
    prompts_file: str | None = None                 # the user's prompt file (any domain name)
    from_sharegpt: bool = False                     # every ShareGPT human turn the classifier routes here
    heldout_only: bool = False                      # with from_sharegpt: instead, the routed turns of the
                                                    # held-out conversations, landed as held-out prompts

    def __post_init__(self):
        domains = tuple(self.domains)
        object.__setattr__(self, "domains", domains)
        if not domains:
            raise ValueError(f"give at least one domain ({', '.join(DOMAINS)})")
        bad = [d for d in domains if not is_domain_name(d)]
        if bad:
            raise ValueError(f"domain {bad[0]!r} is not a lowercase name of [a-z0-9_-]")
        unknown = [d for d in domains if d not in DOMAINS]
        sources = [n for n in ("code_from", "prompts_file") if getattr(self, n) is not None]
        if self.from_sharegpt:
            sources.append("from_sharegpt")
        if len(sources) > 1:
            raise ValueError(f"choose one prompt source, not {' and '.join(sources)}")
        if self.from_sharegpt and unknown:
            raise ValueError(f"ShareGPT turns are routed to {', '.join(DOMAINS)} only, not {unknown[0]!r}")
        if unknown and self.prompts_file is None:
            raise ValueError(f"domain {unknown[0]!r} has no built-in prompts ({', '.join(DOMAINS)} do); give "
                             f"it a prompt file (prompts_file)")
        if self.per_domain is not None and self.per_domain < 1:
            raise ValueError(f"per_domain must be >= 1, got {self.per_domain}")
        for name in ("batch_size", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        extra = set(self.sampling or {}) - set(SERVING_SAMPLING)
        if extra:
            raise ValueError(f"unknown sampling key {sorted(extra)[0]!r}; use {', '.join(SERVING_SAMPLING)}")
        if self.heldout_only and not self.from_sharegpt:
            raise ValueError("heldout_only lands the held-out conversations' ShareGPT turns: it needs from_sharegpt")
        if self.heldout_only and self.train_only:
            raise ValueError("heldout_only and train_only exclude each other")
        if self.code_from is not None and domains != ("code",):
            raise ValueError(f"code_from mines prompts for the code domain only, got domains {list(domains)}")

    def sampling_params(self, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        sp = {**SERVING_SAMPLING, **(self.sampling or {})}
        return SamplingParams(temperature=float(sp["temperature"]), top_p=float(sp["top_p"]), top_k=int(sp["top_k"]),
                              max_new_tokens=self.max_new_tokens, stop_token_ids=tuple(stop_token_ids))


@dataclass(frozen=True)
class _Run:
    """What every domain of one bootstrap run shares."""

    target: object                      # a loaded Target
    home: Path
    cfg: BootstrapConfig
    params: SamplingParams
    encode: Callable[[Prompt], list[int]]
    progress: bool
    log: Callable[[str], None]


def heldout_conversation_rule(home: Path, seed: int, heldout_fraction: float) -> Callable[[str], bool]:
    """``first_turn_id -> True`` when that ShareGPT conversation's first turn is (or would be) a held-out
    chat prompt: by the chat domain's recorded split where it has one, else by its hash rule (the recorded
    rule when the split file exists, else ``seed`` / ``heldout_fraction``)."""
    path = split_file(home, "chat")
    if path.exists():
        data = load_split(home, "chat")
        assigned, seed, heldout_fraction = data["assignments"], data["seed"], data["heldout_fraction"]
    else:
        assigned = {}
    return lambda fid: assigned.get(fid, split_of(fid, heldout_fraction, seed)) == "heldout"


def source_prompts(home: Path, domain: str, cfg: BootstrapConfig, log: Callable[[str], None] = lambda _: None
                   ) -> list[Prompt]:
    """The prompts a bootstrap run of ``domain`` draws from, first ``cfg.per_domain`` (all when None; 64
    from a built-in source when None): the user's prompt file, the ShareGPT turns routed to the domain
    (whole conversations whose first turn is held-out chat left out), stubs mined from Python source, or
    the domain's built-in source. File prompts keep the file's order (a file grown by appending keeps its
    earlier prompts first); routed ShareGPT turns a seeded order. With ``cfg.heldout_only``, the routed turns
    of the held-out conversations instead (less any text a kept conversation also has)."""
    if cfg.prompts_file is not None:
        prompts, rejected = read_prompt_file(Path(cfg.prompts_file), domain)
        for n, reason in rejected[:5]:
            log(f"{cfg.prompts_file}: skipped {reason}")
        if len(rejected) > 5:
            log(f"{cfg.prompts_file}: skipped {len(rejected) - 5} more record(s)")
        return prompts if cfg.per_domain is None else prompts[:cfg.per_domain]
    if cfg.from_sharegpt:
        excluded = heldout_conversation_rule(home, cfg.seed, cfg.heldout_fraction)
        texts = (sharegpt_heldout_prompts(domain, excluded) if cfg.heldout_only
                 else sharegpt_routed_prompts(domain, excluded))
        texts = [texts[i] for i in _seeded_positions(len(texts), cfg.seed)]
        texts = texts if cfg.per_domain is None else texts[:cfg.per_domain]
        return [Prompt(domain, prompt_id_of(t), t) for t in texts]
    return load_prompts(domain, 64 if cfg.per_domain is None else cfg.per_domain, cfg.seed, code_from=cfg.code_from)


def _seeded_positions(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def bootstrap_traces(target, home: Path, cfg: BootstrapConfig = BootstrapConfig(),
                     encode: Callable[[str], list[int]] | None = None, progress: bool = True,
                     log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """Land bootstrap traces for each domain and record its split; returns a summary per domain.

    ``target`` is a loaded :class:`~dspark_core.model.target.Target` (runner, fingerprint, stop_token_ids,
    tokenizer). ``encode`` maps prompt text to token ids; the default applies the target tokenizer's chat
    template. Summary per domain: prompts, new, skipped, tokens, seconds, tokens_per_s, train, heldout
    (over the domain's recorded split restricted to this run's prompts), features_stored, file.
    ``cfg.feature_taps``: store the training sequences' target features for these tap layers as they are
    generated (:mod:`dspark_core.data.features`). ``cfg.code_from`` (code domain only): prompts mined from
    local Python source (:func:`~dspark_core.data.prompts.source_code_prompts`) instead of HumanEval. They
    are extra training data and nothing else: the run is always ``train_only``, so the code domain's
    held-out set (what `dspark eval` and the benches measure) stays HumanEval's, unless ``cfg.heldout_only``
    adds the routed turns of the held-out ShareGPT conversations to it: recorded held-out whatever the hash
    rule says, one completion each, and never in any training run (their conversations are left out of
    every ``from_sharegpt`` run, and a text a kept conversation also has is left out here).
    """
    if (cfg.code_from is not None or cfg.from_sharegpt) and not cfg.heldout_only:
        cfg = replace(cfg, train_only=True)
    tokenizer = getattr(target, "tokenizer", None)
    if encode is None and tokenizer is None:
        raise ValueError("this target has no tokenizer; pass encode=")
    text_encode = encode or (lambda text: encode_prompt(tokenizer, text, chat=True))

    def encode_any(p: Prompt) -> list[int]:
        if p.messages is not None and tokenizer is not None:
            return encode_messages(tokenizer, p.chat_messages())
        return text_encode(p.text)

    run = _Run(target, Path(home), cfg, cfg.sampling_params(target.stop_token_ids), encode_any, progress, log)
    summary = {}
    for domain in cfg.domains:
        prompts = source_prompts(home, domain, cfg, log)
        split = record_split(home, domain, prompts, cfg.heldout_fraction, cfg.seed, log,
                             side="heldout" if cfg.heldout_only else None)["assignments"]
        res = _bootstrap_domain(run, domain, prompts, split)
        held = sum(split[p.prompt_id] == "heldout" for p in prompts)
        summary[domain] = {"prompts": len(prompts), **res, "train": len(prompts) - held, "heldout": held}
        log(f"{domain}: {res['new']} new, {res['skipped']} already there, {res['tokens']} tokens "
            f"({res['tokens_per_s']} tok/s) -> {res['file']}")
    return summary


def _bootstrap_domain(run: _Run, domain: str, prompts: list[Prompt], split: dict[str, str]) -> dict:
    """Generate and land traces for the prompts of one domain not yet in its bootstrap file.

    With ``samples_per_prompt`` > 1, prompts that ``split`` puts in ``"train"`` get that many completions
    (greedy decoding has one). ``train_only`` skips held-out prompts (extra training data only),
    ``heldout_only`` training ones.
    ``feature_taps``: also store the target features of the training prompts' sequences for these tap
    layers (:mod:`dspark_core.data.features`), so training need not run the target over them again."""
    target, cfg, params = run.target, run.cfg, run.params
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens}
    path = bootstrap_file(run.home, domain, target.fingerprint, sampling)
    done = _existing(path, sampling, run.log)
    tag = sampling_tag(sampling)
    rid = f"bootstrap-{target.fingerprint[:12]}-" + (f"{tag}-" if tag else "")
    is_train = lambda pid: split.get(pid) == "train"  # noqa: E731
    n_samples = 1 if params.temperature == 0.0 else cfg.samples_per_prompt
    wanted = [(p, j) for p in prompts
              if (is_train(p.prompt_id) or not cfg.train_only) and not (cfg.heldout_only and is_train(p.prompt_id))
              for j in range(n_samples if is_train(p.prompt_id) else 1)]
    todo = [(p, j) for p, j in wanted if rid + sample_key(p.prompt_id, j) not in done]
    device = str(target.runner.device)
    prompt_of = {sample_key(p.prompt_id, j): p.prompt_id for p, j in todo}
    requests = [BatchRequest(sample_key(p.prompt_id, j), run.encode(p), params,
                             make_generator(prompt_seed(cfg.seed, p.prompt_id if j == 0 else f"{p.prompt_id}#s{j}"),
                                            device)) for p, j in todo]
    tokens = [0]
    bar = None
    if run.progress and todo:
        from tqdm.auto import tqdm                  # only where a bar is shown
        bar = tqdm(total=len(todo), desc=f"bootstrap {domain}", unit="completion", dynamic_ncols=True)

    def on_result(res: BatchResult) -> None:
        rec = TraceRecord(
            request_id=rid + res.key, timestamp=utc_now_iso(), domain=domain,
            prompt_id=prompt_of[res.key], prompt_ids=list(res.prompt_ids), completion_ids=list(res.token_ids),
            sampling=sampling, target_fingerprint=target.fingerprint, drafter=None, rounds=[],
            source="bootstrap", finish_reason=res.finish_reason)
        write_jsonl([rec], path)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens[0] / max(time.perf_counter() - t0, 1e-9):.1f}")

    def on_token(n: int) -> None:
        tokens[0] += n

    capture = None
    if cfg.feature_taps and todo:
        capture = FeatureCapture(FeatureStore.for_target(run.home, target.fingerprint), tuple(cfg.feature_taps),
                                 only={k for k, pid in prompt_of.items() if is_train(pid)})
    t0 = time.perf_counter()
    try:
        if todo:
            generate_batch(target.runner, requests, cfg.batch_size, on_result=on_result, on_token=on_token,
                           capture=capture)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    return {"new": len(todo), "skipped": len(wanted) - len(todo), "tokens": tokens[0],
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens[0] / seconds, 2) if todo else 0.0,
            "features_stored": capture.stored if capture is not None else 0, "file": str(path)}

"""Serving fixtures: a tiny seeded target with a character-level tokenizer (built locally, no downloads),
test-only drafter sources, and a live uvicorn server on a random loopback port."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


from dspark_core.engine.decode_one import generate
from dspark_core.drafters import build_proposer
from dspark_core.engine.sampling import SamplingParams
from tiny_models import SelfDraftProposer  # noqa: F401  (serving tests import it from here)
from serving.drafters import DrafterNotFound, LoadedDrafter, RollbackUnsupported
from tiny_models import peaky, tiny_target

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?'\"()[]=+-*/_#\n<>{}|"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer():
    """A 64-token character-level HF tokenizer: <eos>, <unk> and 62 characters (input lower-cased)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    assert len(vocab) == 64
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_target(seed: int = 5):
    t = tiny_target("llama", vocab=64, seed=seed)
    tok = char_tokenizer()
    return dataclasses.replace(t, tokenizer=tok, stop_token_ids=(tok.eos_token_id,))


def plain_ids(target, prompt_ids: list[int], max_new: int, ignore_eos: bool = False) -> list[int]:
    """Plain greedy decoding (no proposer): the reference every served greedy output must equal."""
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=() if ignore_eos else tuple(target.stop_token_ids))
    return generate(target.runner, prompt_ids, params).token_ids


def peaky_dspark(target, seed: int, block: int = 4):
    """A tiny DSpark drafter with large random weights: confident, often wrong, sometimes right."""
    return peaky(build_proposer("dspark", target.runner, target.fingerprint, preset="tiny", block_size=block), seed)


class FakeSource:
    """An in-memory drafter source: ``versions[domain][v]`` is a zero-argument proposer factory; the alias
    ``champion`` points at ``champion[domain]``."""

    name = "fake"

    def __init__(self, versions: dict, champion: dict):
        self.versions, self.champion = versions, champion

    def domains(self):
        return sorted(self.versions)

    def alias_version(self, domain, alias):
        return self.champion.get(domain) if alias == "champion" else None

    def load(self, domain, alias=None, version=None):
        v = version if version is not None else self.alias_version(domain, alias or "champion")
        if v is None or v not in self.versions.get(domain, {}):
            raise DrafterNotFound(f"{domain}: no version {v}")
        return LoadedDrafter(domain, self.versions[domain][v](), f"fake-{domain}:v{v}", v, self.name, "fake")

    def rollback(self, domain, reason):
        raise RollbackUnsupported(f"the {self.name} drafter source has no registry to roll back")


class LiveServer:
    """uvicorn on 127.0.0.1 with a random free port (the socket is bound here, so no race), in a thread."""

    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 60 or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def serve(target, source, tmp_path, **overrides):
    """A live server for ``target`` with drafters from ``source`` (context manager)."""
    from serving.app import create_app
    from serving.server import build_server
    from serving.settings import ServeSettings
    kw = dict(home=tmp_path / "home", max_batch=16, policy="fixed", shadow_fraction=0.25, poll_interval=0,
              domains=("code", "chat"), default_domain="chat", canary_rounds=16, acceptance_window=64)
    kw.update(overrides)
    state = build_server(ServeSettings(**kw), target, source)
    return LiveServer(create_app(state)), state

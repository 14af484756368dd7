"""Tiny seeded random targets for hermetic CPU tests (no downloads)."""

from __future__ import annotations

import time

import torch

from dspark_core.engine.decode_one import generate
from dspark_core.engine.proposer import Draft
from dspark_core.engine.sampling import SamplingParams
from dspark_core.model.layers import Rotary
from dspark_core.model.runner import TargetRunner
from dspark_core.model.target import Target, fingerprint


def tiny_hf_model(family: str = "llama", vocab: int = 64, layers: int = 4, seed: int = 0, init: float = 0.3,
                  tie: bool = True, local: bool = False):
    """A small random HF causal LM; ``init`` (weight std) makes its distributions usefully peaky.

    ``local`` scales every attention output projection down to 5%, so the next token depends mostly on
    the current one: a learnable (bigram-like) target for training tests.
    """
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  initializer_range=init, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, head_dim=8)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=8)
    else:
        raise ValueError(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if family == "qwen2":  # give the q/k/v biases non-zero values so the test covers them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.1)
        if local:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.data.mul_(0.05)
        if family == "qwen3":
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.self_attn.q_norm.weight, mean=1.0, std=0.2)
                torch.nn.init.normal_(layer.self_attn.k_norm.weight, mean=1.0, std=0.2)
    return model.eval()


def runner_for(model, dtype: torch.dtype = torch.float32) -> TargetRunner:
    from dspark_core.model.runner import TargetArch
    rot = model.model.rotary_emb
    rotary = Rotary(rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)), 512)
    return TargetRunner(TargetArch.from_hf_config(model.config), model.state_dict(), rotary, dtype=dtype)


def tiny_target(family: str = "llama", **kw) -> Target:
    model = tiny_hf_model(family, **kw)
    runner = runner_for(model)
    return Target(name=f"tiny-{family}", runner=runner, tokenizer=None, hf_config=model.config,
                  fingerprint=fingerprint(model.config, model.state_dict()), path=None, stop_token_ids=(),
                  reference=model)


class OracleProposer:
    """Test-only proposer that drafts a known continuation, corrupting some positions.

    It makes long accepted runs, partial acceptance and full rejection all frequent, so the decode
    loop's commit and rollback bookkeeping is exercised far more than an untrained drafter would.
    """

    name = "oracle"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], vocab: int, block: int = 5, corrupt_every: int = 3):
        self.continuation, self.vocab = continuation, vocab
        self.max_block, self.corrupt_every = block, corrupt_every
        self.calls = 0

    def start(self, prompt_ids, taps):
        return {"pos": 1}          # the first generated token comes from the prefill

    def propose(self, state, anchor, k, params, generator):
        from dspark_core.engine.proposer import Draft
        self.calls += 1
        toks = list(self.continuation[state["pos"]:state["pos"] + k])
        if toks and self.calls % self.corrupt_every == 0:
            j = self.calls % len(toks)
            toks[j] = (toks[j] + 1) % self.vocab
        return Draft(torch.tensor(toks, dtype=torch.long))

    def commit(self, state, tokens, taps):
        state["pos"] += len(tokens)


def peaky(prop, seed: int):
    """Re-initialise a model proposer's matrices with large seeded weights: confident, often wrong,
    sometimes right (exercises acceptance and rejection). Model-free proposers pass through."""
    if hasattr(prop, "drafter"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for p in prop.drafter.parameters():
                if p.dim() >= 2:
                    torch.nn.init.normal_(p, std=0.5)
    return prop


class SelfDraftProposer:
    """Test-only oracle: drafts the target's own greedy continuation (full acceptance under greedy)."""

    name = "self-draft"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, runner, block: int = 4, delay: float = 0.0):
        self.runner, self.max_block, self.delay = runner, block, delay

    def start(self, prompt_ids, taps):
        return {"ids": list(prompt_ids)}

    def propose(self, state, anchor, k, params, generator):
        if self.delay:
            time.sleep(self.delay)
        toks = generate(self.runner, state["ids"] + [anchor], SamplingParams(max_new_tokens=k)).token_ids
        return Draft(torch.tensor(toks[:k], dtype=torch.long))

    def commit(self, state, tokens, taps):
        state["ids"].extend(tokens)

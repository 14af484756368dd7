"""What the engines' drafter formats and ours share: weight names, target-layer ids and the vocabulary maps.

Target-layer ids, three conventions for the same residual stream (``hidden_states`` is the tuple a
transformers model returns with ``output_hidden_states``: index 0 the embeddings, index i the stream after
decoder layer i - 1):

=========================== ============================= ===============================
format                      id of the stream after layer j its config key
=========================== ============================= ===============================
dspark (this project)       j  (-1 = the embeddings)      ``target_layer_ids``
DeepSpec ``Qwen3DSparkModel`` j  (vLLM adds 1 on load)    ``target_layer_ids``
speculators / vLLM          j + 1 (0 = the embeddings)    ``aux_hidden_state_layer_ids``
=========================== ============================= ===============================

So an export writes our ids unchanged for DeepSpec and shifted by one for speculators; an import shifts
back. The final layer's stream is not a tap here (the target runner leaves it out), so a speculators id
equal to the target's layer count is refused on import.

Weight names: ours are the module paths of :class:`~dspark_core.drafters.block.BlockDrafter`; theirs are
the Qwen3 decoder paths both formats use (``layers.{i}.self_attn.q_proj.weight``, ...,
``markov_head.markov_w1.weight``, ``confidence_head.proj.weight``).
"""

from __future__ import annotations

import torch

FORMATS = ("speculators", "deepspec")
SPECULATORS_VERSION = "0.9.0"          # the speculators release whose loader the tests run
# what an export records about its origin, under this key of config.json (both formats ignore it)
PROVENANCE_KEY = "dspark"


class FormatError(ValueError):
    """A drafter cannot be written to, or read from, an engine's format; the message says why."""


def to_format_ids(fmt: str, ours: tuple[int, ...]) -> list[int]:
    """Our tap ids -> the ids the format's config carries."""
    return [t + 1 for t in ours] if fmt == "speculators" else list(ours)


def from_format_ids(fmt: str, theirs: list[int]) -> tuple[int, ...]:
    """A format's target-layer ids -> our tap ids."""
    return tuple(int(t) - 1 for t in theirs) if fmt == "speculators" else tuple(int(t) for t in theirs)


def layer_names(i: int) -> dict[str, str]:
    """Our weight name -> theirs, for draft layer ``i``."""
    ours, theirs = f"layers.{i}.", f"layers.{i}."
    pairs = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
             "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
             "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
             "down_proj.weight": "mlp.down_proj.weight"}
    return {ours + a: theirs + b for a, b in pairs.items()}


def weight_names(num_layers: int) -> dict[str, str]:
    """Our trained weight name -> the formats' name (the draft vocabulary and heads are handled apart)."""
    names = {"fc.weight": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight",
             "markov_in.weight": "markov_head.markov_w1.weight", "markov_out.weight": "markov_head.markov_w2.weight",
             "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}
    for i in range(num_layers):
        names.update(layer_names(i))
    return names


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary (target ids in draft order) -> (``d2t`` as offsets, ``t2d`` bool mask)."""
    ids = target_ids.long().cpu()
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def target_ids_from_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """``d2t`` offsets (and the ``t2d`` mask when present) -> the draft vocabulary's target ids, checked."""
    ids = torch.arange(d2t.numel()) + d2t.long().cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise FormatError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise FormatError("d2t maps two draft ids to the same target token")
    if t2d is not None:
        t2d = t2d.bool().cpu()
        if t2d.numel() != vocab_size or int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
            raise FormatError("t2d and d2t disagree: t2d must mark exactly the target ids d2t maps to")
    return ids

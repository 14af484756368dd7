"""Drafter training against the frozen target with online target features.

The frozen target runs inside the loop (bf16 where the hardware has native bf16 matmuls) to produce the
context taps and the final hidden state of each training sequence; an optional in-memory feature cache
avoids recomputing them in later epochs. Anchors are sampled at response positions; every anchor is one block of
``block_size`` slots. Metrics go to a callback; core never imports a tracking system.

Data parallel: under ``torchrun`` (``WORLD_SIZE`` > 1) :func:`train_drafter` joins the process group
(gloo on CPU, nccl on CUDA) and wraps the drafter, not the frozen target, in DDP. Every rank draws the
same global batch order and trains on its slice of each batch (``batch_size`` stays the global number
of sequences per step); anchors come from a per-rank, per-step generator; DDP averages the gradients;
only rank 0 reports metrics and writes checkpoints. A single process trains without any of this.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dspark_core.model.layers import bf16_is_fast
from dspark_core.training.losses import DraftVocab, LossConfig, drafter_loss
from dspark_core.drafters import BlockDrafter, DrafterConfig, Eagle3Drafter, save_drafter
from dspark_core.drafters.block import block_train_forward
from dspark_core.drafters.eagle3 import eagle3_train_forward
from dspark_core.model.runner import TargetRunner, select_taps


@dataclass
class Example:
    """One training sequence: prompt + response token ids; loss on response positions only."""

    token_ids: list[int]
    response_start: int
    domain: str = ""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 4              # sequences per optimiser step
    anchors_per_seq: int = 32
    lr: float = 1e-3
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_seq_len: int = 512
    seed: int = 0
    autocast_bf16: bool | None = None   # None: where bf16 matmuls are native (layers.bf16_is_fast); emulated
                                        # bf16 (an AVX2-only CPU) made a training step slower, not faster
    checkpoint_every: int = 100
    loss: LossConfig = field(default_factory=LossConfig)

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr_frac * lr (step is 0-based)."""
    warm = max(1, int(round(cfg.warmup_frac * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, n: int, gen: torch.Generator,
                   min_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions a with loss_mask[a] and loss_mask[a + 1] (both in the response), a >= min_pos.

    loss_mask [B, S] bool; lengths [B]. Returns anchors [B, n] (sorted, padded with a valid dummy
    position) and keep [B, n] bool.
    """
    B, S = loss_mask.shape
    cand = loss_mask[:, :-1] & loss_mask[:, 1:]
    cand[:, :min_pos] = False
    anchors = torch.zeros(B, n, dtype=torch.long)
    keep = torch.zeros(B, n, dtype=torch.bool)
    for b in range(B):
        idx = cand[b].nonzero().squeeze(-1)
        if idx.numel() == 0:
            anchors[b] = max(min_pos, 0)
            continue
        chosen = idx[torch.randperm(idx.numel(), generator=gen)[:n]].sort().values
        anchors[b, :chosen.numel()] = chosen
        anchors[b, chosen.numel():] = chosen[0]
        keep[b, :chosen.numel()] = True
    return anchors, keep


def block_labels(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, A, G] = token at anchor + i + 1; valid = supervised contiguous prefix of each block."""
    B, S = tokens.shape
    pos = anchors[:, :, None] + torch.arange(1, G + 1)                              # [B, A, G]
    inside = pos < S
    posc = pos.clamp(max=S - 1)
    labels = tokens.gather(1, posc.view(B, -1)).view(B, -1, G)
    ok = inside & loss_mask.gather(1, posc.view(B, -1)).view(B, -1, G) & keep[:, :, None]
    valid = torch.cumprod(ok.int(), dim=-1).bool()
    return labels, valid


class FeatureSource:
    """Target taps, final hidden states and the log-normaliser of the target's next-token logits for
    training sequences, read from a feature store or computed online, and kept in memory.

    One source can serve several trainings over the same examples (e.g. DSpark, DFlash and Eagle3 at
    equal budget): it computes the union of the tap layers once per sequence, and :meth:`get` returns
    the columns of the layers asked for. Keeping the full-vocabulary log-normaliser (one float per
    position) lets a training step run the target's LM head over the draft vocabulary only. With a
    ``store`` (:class:`~dspark_core.data.features.FeatureStore`, filled by bootstrap as it generates the
    sequences), a stored sequence that has these tap layers is read instead of run through the target.
    """

    LSE_CHUNK = 256                       # positions per full-vocabulary matmul (bounds its memory)

    def __init__(self, runner: TargetRunner, taps: tuple[int, ...], cache: bool = True, store=None):
        self.runner, self.taps, self.use_cache, self.store = runner, tuple(taps), cache, store
        self._cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.computed = 0
        self.loaded = 0                       # sequences read from the store

    def get(self, key: int, token_ids: list[int], taps: tuple[int, ...] | None = None,
            source_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(taps [S, F], last hidden [S, d], log-normaliser [S] fp32) of one sequence. ``source_ids``: the
        whole sequence ``token_ids`` was cut from (its stored features cover the prefix)."""
        ck = tuple(token_ids)                 # content-keyed (exact): any example list can share it
        if self.use_cache and ck in self._cache:
            all_taps, last, lse = self._cache[ck]
        else:
            got = self._from_store(token_ids, source_ids)
            if got is not None:
                all_taps, last, lse = got
                self.loaded += 1
            else:
                all_taps, last, lse = self._compute(token_ids)
                self.computed += 1
            if self.use_cache:
                self._cache[ck] = (all_taps, last, lse)
        if taps is not None:
            all_taps = select_taps(all_taps, self.taps, tuple(taps), last.shape[-1])
        return all_taps, last, lse

    def _from_store(self, token_ids: list[int], source_ids: list[int] | None):
        if self.store is None:
            return None
        src = list(source_ids) if source_ids is not None else list(token_ids)
        if src[:len(token_ids)] != list(token_ids):
            return None
        got = self.store.get(src, len(token_ids))
        if got is None or any(t not in got[0] for t in self.taps):
            return None
        have, all_taps, last, lse = got
        r = self.runner
        all_taps = select_taps(all_taps, have, self.taps, last.shape[-1])
        return all_taps.to(r.device, r.dtype), last.to(r.device, r.dtype), lse.to(r.device)

    def _compute(self, token_ids: list[int]):
        r = self.runner
        cache = r.new_cache(1, len(token_ids) + 1)
        out = r.forward(cache, torch.tensor([token_ids]), taps=self.taps, logits="none", want_last_hidden=True)
        all_taps, last = out.taps[0], out.last_hidden[0]                            # [S, F], [S, d]
        with torch.no_grad():
            lse = torch.cat([(h @ r.lm_head.T).float().logsumexp(-1) for h in last.split(self.LSE_CHUNK)])
        return all_taps, last, lse


@dataclass
class TrainResult:
    steps: int
    final_metrics: dict
    history: list[dict]
    seconds: float
    checkpoint: Path | None
    resumed_from: int = 0            # the step a resumed run started at


def _collate(examples: list[Example], idx: list[int], feats: FeatureSource, max_len: int,
             tap_layers: tuple[int, ...]):
    seqs = [examples[i].token_ids[:max_len] for i in idx]
    S = max(len(s) for s in seqs)
    B = len(seqs)
    tokens = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    lse = torch.zeros(B, S)
    taps = last = None
    for b, (i, s) in enumerate(zip(idx, seqs)):
        tokens[b, :len(s)] = torch.tensor(s)
        loss_mask[b, examples[i].response_start:len(s)] = True
        t, h, z = feats.get(i, s, tap_layers, source_ids=examples[i].token_ids)
        if taps is None:
            taps = t.new_zeros(B, S, t.shape[-1])
            last = h.new_zeros(B, S, h.shape[-1])
        taps[b, :len(s)] = t
        last[b, :len(s)] = h
        lse[b, :len(s)] = z
    return tokens, loss_mask, taps, last, lse.to(last.device), torch.tensor([len(s) for s in seqs])


def _slot_targets(last: torch.Tensor, lse: torch.Tensor, head: torch.Tensor, anchors: torch.Tensor,
                  G: int) -> torch.Tensor:
    """The frozen target's probabilities [B, A, G, Vd] at every block slot, over the draft vocabulary.

    Slot i of an anchor at p predicts the token at p + i + 1 from the hidden state at p + i. last [B, S, d]
    final hidden states; lse [B, S] the log-normaliser of the target's full-vocabulary logits there (so
    the probabilities are normalised over the full vocabulary: a row's mass outside the draft vocabulary
    is 1 - its sum); head [Vd, d] the LM-head rows of the draft vocabulary. Many anchors share positions
    (128 anchors of 7 slots on a 160-token response read every position ~5 times): the head runs once
    per distinct position, and only over the draft vocabulary.
    """
    B, S, d = last.shape
    slot_pos = (anchors[:, :, None] + torch.arange(G, device=anchors.device)).clamp(max=S - 1)
    flat = (torch.arange(B, device=anchors.device)[:, None, None] * S + slot_pos).reshape(-1)
    rows, inverse = torch.unique(flat, return_inverse=True)
    with torch.no_grad():
        logits = (last.reshape(B * S, d)[rows] @ head.T).float()                    # [R, Vd]
        probs = (logits - lse.reshape(B * S)[rows, None]).exp()
    return probs[inverse].view(B, anchors.shape[1], G, -1)


class _TrainForward(torch.nn.Module):
    """The drafter's teacher-forced pass as one module call, so DDP sees the forward it must sync."""

    def __init__(self, model: BlockDrafter | Eagle3Drafter):
        super().__init__()
        self.model = model

    def forward(self, taps, tokens, anchors, keep):
        if self.model.cfg.kind == "eagle3":
            return eagle3_train_forward(self.model, taps, tokens, anchors, keep, self.model.cfg.block_size), None
        return block_train_forward(self.model, taps, tokens, anchors, keep)


def _join_process_group(device: torch.device) -> tuple[int, int, bool]:
    """``(rank, world_size, owned)``: the caller's process group if one is initialised, else one
    initialised here from torchrun's environment (``owned``), else ``(0, 1, False)``."""
    dist = torch.distributed
    if not dist.is_available() or (not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) <= 1):
        return 0, 1, False
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), owned


def _anchor_generator(seed: int, step: int, rank: int, world: int) -> torch.Generator:
    """A distinct, resumable stream per (step, rank) for data-parallel anchor sampling."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank + 1)


def _state_path(folder: Path) -> Path:
    return Path(folder) / "train_state.pt"


@dataclass
class _RunState:
    """What a resumed training continues from besides the drafter's weights; saved with every checkpoint."""

    opt: torch.optim.Optimizer
    gen: torch.Generator                 # the example order (and, in one process, the anchors)
    step: int = 0                        # optimiser steps done
    history: list[dict] = field(default_factory=list)
    order: list[int] = field(default_factory=list)     # the rest of the current pass over the examples

    def restore(self, model: torch.nn.Module, path: Path) -> None:
        st = torch.load(path, weights_only=False)
        model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optimizer"])
        self.gen.set_state(st["generator"])
        self.step, self.history, self.order = st["step"], st["history"], st["order"]

    def save(self, model: torch.nn.Module, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": self.opt.state_dict(), "generator": self.gen.get_state(),
                    "step": self.step, "history": self.history, "order": self.order}, tmp)
        tmp.replace(path)                # atomic: a crash leaves the previous state

    def next_batch(self, n_examples: int, batch_size: int) -> list[int]:
        """The next ``batch_size`` example indices; a new random pass starts when the current one runs out."""
        if len(self.order) < batch_size:
            self.order = self.order + torch.randperm(n_examples, generator=self.gen).tolist()
        idx, self.order = self.order[:batch_size], self.order[batch_size:]
        return idx


@dataclass(frozen=True)
class _Batch:
    """One optimiser step's inputs: B sequences of S tokens, A anchors per sequence, G slots per anchor."""

    tokens: torch.Tensor                 # [B, S]
    taps: torch.Tensor                   # [B, S, F] target taps
    anchors: torch.Tensor                # [B, A]
    keep: torch.Tensor                   # [B, A] bool: a real anchor (not padding)
    labels: torch.Tensor                 # [B, A, G] the token each slot should draft
    valid: torch.Tensor                  # [B, A, G] bool: the supervised prefix of each block
    target_probs: torch.Tensor           # [B * A, G, Vd] the target's probabilities at each slot


def _make_batch(examples: list[Example], idx: list[int], feats: FeatureSource, cfg: TrainConfig,
                drafter: DrafterConfig, anchor_gen: torch.Generator, draft_head: torch.Tensor) -> _Batch:
    G = drafter.block_size
    tokens, loss_mask, taps, last, lse, lengths = _collate(examples, idx, feats, cfg.max_seq_len,
                                                           tuple(drafter.target_layer_ids))
    anchors, keep = sample_anchors(loss_mask, lengths, cfg.anchors_per_seq, anchor_gen,
                                   min_pos=1 if drafter.kind == "eagle3" else 0)
    labels, valid = block_labels(tokens, loss_mask, anchors, keep, G)
    B, A = anchors.shape
    target_probs = _slot_targets(last, lse, draft_head, anchors, G).view(B * A, G, -1)
    return _Batch(tokens, taps, anchors, keep, labels, valid, target_probs)


def _optimiser_step(forward: torch.nn.Module, batch: _Batch, opt: torch.optim.Optimizer, params: list,
                    cfg: TrainConfig, step: int, device: torch.device, vocab: DraftVocab | None) -> dict:
    """Set the learning rate, run the drafter, take one AdamW step; returns this step's metrics."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        logits, conf = forward(batch.taps, batch.tokens, batch.anchors, batch.keep)
    B, A, G = batch.labels.shape
    loss, metrics = drafter_loss(logits.reshape(B * A, G, -1), batch.target_probs, batch.labels.view(B * A, G),
                                 batch.valid.view(B * A, G), cfg.loss,
                                 None if conf is None else conf.reshape(B * A, G), vocab)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    metrics.update(step=step + 1, lr=opt.param_groups[0]["lr"], grad_norm=float(gnorm),
                   supervised_slots=int(batch.valid.sum()))
    return metrics


def _mean_over_ranks(metrics: dict, world: int, device: torch.device) -> dict:
    """Each scalar metric's mean over the data-parallel ranks (supervised slots: their sum; lr and grad_norm
    as on this rank)."""
    keys = [k for k, v in metrics.items() if isinstance(v, float) and k not in ("lr", "grad_norm")]
    t = torch.tensor([metrics[k] for k in keys] + [metrics["supervised_slots"]], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    metrics.update(zip(keys, (t[:-1] / world).tolist()), supervised_slots=int(t[-1]))
    return metrics


def _wrap_for_ranks(forward: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """DDP around the drafter's forward when there are several ranks. The frozen buffers (target embeddings,
    LM head) are equal on every rank, so DDP does not re-broadcast them."""
    if world == 1:
        return forward
    ddp = torch.nn.parallel.DistributedDataParallel
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters \
        else "broadcast_buffers"                            # the older name, deprecated since torch 2.13
    return ddp(forward, device_ids=[device] if device.type == "cuda" else None, **{no_sync: False})


# Eleven parameters: what is trained (runner, model, examples, cfg), where its checkpoints go (out_dir,
# target_fingerprint, extra_meta) and how the run is driven (callback, resume, progress, features).
def train_drafter(runner: TargetRunner, model: BlockDrafter | Eagle3Drafter, examples: list[Example],
                  cfg: TrainConfig, out_dir: Path | None = None, target_fingerprint: str = "",
                  callback: Callable[[int, dict], None] | None = None, *, resume: bool = True,
                  progress: bool = True, extra_meta: dict | None = None,
                  features: FeatureSource | None = None,
                  stop: Callable[[int], bool] | None = None) -> TrainResult:
    """Train ``model`` (fp32 master weights, bf16 autocast where bf16 is native) on ``examples``; resumable
    from ``out_dir``.

    ``features`` may be shared between trainings (it is keyed by sequence content). ``stop(step)``, asked
    after each step (after ``callback``), ends the run there early with a checkpoint: the learning-rate
    schedule stays the one of ``cfg.steps``, and a later call resumes where it stopped.
    """
    if not examples:
        raise ValueError("no training examples")
    examples = [e for e in examples if len(e.token_ids[:cfg.max_seq_len]) - e.response_start >= 2]
    if not examples:
        raise ValueError("no example has at least 2 response tokens within max_seq_len")
    rank, world, owned_group = _join_process_group(runner.device)
    if cfg.batch_size < world:
        raise ValueError(f"batch_size {cfg.batch_size} is smaller than the {world} data-parallel ranks")
    model.float().train()
    feats = features or FeatureSource(runner, tuple(model.cfg.target_layer_ids))
    params = [p for p in model.parameters() if p.requires_grad]
    run = _RunState(torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8),
                    torch.Generator().manual_seed(cfg.seed))
    state_file = _state_path(out_dir) if out_dir else None
    if resume and state_file is not None and state_file.exists():
        run.restore(model, state_file)
    start_step = run.step
    use_autocast = bf16_is_fast(runner.device) if cfg.autocast_bf16 is None else bool(cfg.autocast_bf16)
    cfg = replace(cfg, autocast_bf16=use_autocast)            # checkpoints record what ran
    vocab = DraftVocab(model.head.vocab_ids, runner.lm_head.shape[0]) if model.head.trimmed else None
    draft_head = runner.lm_head if vocab is None else runner.lm_head[vocab.ids]        # [Vd, d]
    forward = _wrap_for_ranks(_TrainForward(model), runner.device, world)
    if rank != 0:
        callback, progress, out_dir = None, False, None
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm                                 # only where a bar is shown
        bar = tqdm(total=cfg.steps, initial=start_step, desc=f"train {model.cfg.kind}", unit="step", dynamic_ncols=True)
    metrics: dict = {}
    for step in range(start_step, cfg.steps):
        idx = run.next_batch(len(examples), cfg.batch_size)[rank::world]
        anchor_gen = run.gen if world == 1 else _anchor_generator(cfg.seed, step, rank, world)
        batch = _make_batch(examples, idx, feats, cfg, model.cfg, anchor_gen, draft_head)
        metrics = _optimiser_step(forward, batch, run.opt, params, cfg, step, runner.device, vocab)
        if world > 1:                                         # report the mean over ranks
            metrics = _mean_over_ranks(metrics, world, runner.device)
        run.step = step + 1
        run.history.append({k: v for k, v in metrics.items() if not isinstance(v, list)})
        if callback:
            callback(step + 1, metrics)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_expected']:.2f}")
        halt = stop is not None and step + 1 < cfg.steps and bool(stop(step + 1))
        if stop is not None and world > 1:                    # rank 0 decides for every rank
            flag = torch.tensor([float(halt)], device=runner.device)
            torch.distributed.broadcast(flag, 0)
            halt = bool(flag.item())
        done = step + 1 == cfg.steps or halt
        if out_dir is not None and (done or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
            _save(model, run, Path(out_dir), target_fingerprint, cfg, extra_meta)
        if halt:
            break
    if bar is not None:
        bar.close()
    if owned_group:     # release DDP's hold on the group, then leave together (a rank that left early hung)
        del forward
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    model.eval()
    return TrainResult(run.step, metrics, run.history, time.perf_counter() - t0, out_dir, start_step)


def _save(model: BlockDrafter | Eagle3Drafter, run: _RunState, out_dir: Path, fingerprint: str, cfg: TrainConfig,
          extra: dict | None) -> None:
    """A loadable drafter checkpoint plus the state to resume from and the metric history."""
    save_drafter(model, out_dir, fingerprint, extra={"train": cfg.to_dict() | {"loss": asdict(cfg.loss)},
                                                      "step": run.step, **(extra or {})})
    run.save(model, _state_path(out_dir))
    (out_dir / "history.json").write_text(json.dumps(run.history))


@torch.no_grad()
def teacher_forced_eval(runner: TargetRunner, model: BlockDrafter | Eagle3Drafter, examples: list[Example],
                        features: FeatureSource | None = None, *, anchors_per_seq: int = 32, batch_size: int = 4,
                        seed: int = 0, max_seq_len: int = 512) -> dict:
    """How well a drafter drafts ``examples`` without decoding them: blocks at anchors drawn with a fixed
    seed along each response, the drafter fed the target's features there (teacher forcing, as in
    training), its slots scored against the target's own distribution at each position.

    Returns ``tau_expected`` (T = 1: 1 + sum_k prod_{i<=k} (1 - TV_i), what speculative sampling accepts
    on average), ``tau_greedy`` (1 + the length of the prefix whose draft argmax is the target's argmax; a
    lower bound where the draft vocabulary is trimmed: a slot counts only when the target's top token in
    the draft vocabulary outweighs all its mass outside it), both per position (``accept_per_pos``,
    ``greedy_per_pos``: P(slot k agrees | supervised)), and the ``blocks`` and ``sequences`` scored. The
    same examples and seed give the same blocks, so two drafters (or two checkpoints) are compared on the
    same draws. Cheap next to a decode: one drafter forward per batch and the target's features (read from
    ``features`` when it holds them)."""
    examples = [e for e in examples if len(e.token_ids[:max_seq_len]) - e.response_start >= 2]
    if not examples:
        raise ValueError("no example has at least 2 response tokens")
    cfg = TrainConfig(batch_size=batch_size, anchors_per_seq=anchors_per_seq, max_seq_len=max_seq_len, seed=seed)
    feats = features or FeatureSource(runner, tuple(model.cfg.target_layer_ids))
    vocab = DraftVocab(model.head.vocab_ids, runner.lm_head.shape[0]) if model.head.trimmed else None
    draft_head = runner.lm_head if vocab is None else runner.lm_head[vocab.ids]
    forward = _TrainForward(model)
    was_training = model.training
    model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    G = model.cfg.block_size
    sums = {"t1": torch.zeros(G), "greedy": torch.zeros(G), "valid": torch.zeros(G)}
    tau_t1 = tau_greedy = 0.0
    blocks = 0
    try:
        for lo in range(0, len(examples), batch_size):
            batch = _make_batch(examples, list(range(lo, min(len(examples), lo + batch_size))), feats, cfg,
                                model.cfg, gen, draft_head)
            logits, _ = forward(batch.taps, batch.tokens, batch.anchors, batch.keep)
            B, A, G = batch.labels.shape
            logits = logits.reshape(B * A, G, -1).float()
            tp = batch.target_probs.float()                                    # [N, G, Vd]
            valid = batch.valid.view(B * A, G)
            t1 = torch.minimum(logits.softmax(-1), tp).sum(-1).clamp(0.0, 1.0)
            top, arg = tp.max(-1)
            greedy = ((logits.argmax(-1) == arg) & (top > 1.0 - tp.sum(-1))).float()
            keep = valid[:, 0]
            for name, x in (("t1", t1), ("greedy", greedy)):
                x = torch.where(valid, x, torch.zeros_like(x))[keep]
                sums[name] += x.sum(0)
                surv = torch.cumprod(x, dim=-1).sum(-1)
                if name == "t1":
                    tau_t1 += float(surv.sum())
                else:
                    tau_greedy += float(surv.sum())
            sums["valid"] += valid[keep].float().sum(0)
            blocks += int(keep.sum())
    finally:
        model.train(was_training)
    per = lambda k: (sums[k] / sums["valid"].clamp_min(1)).tolist()  # noqa: E731
    return {"tau_expected": 1.0 + tau_t1 / max(blocks, 1), "tau_greedy": 1.0 + tau_greedy / max(blocks, 1),
            "accept_per_pos": per("t1"), "greedy_per_pos": per("greedy"), "blocks": blocks,
            "sequences": len(examples)}


def top_token_vocab(examples: list[Example], size: int, vocab: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids in the examples (ties by id), plus ``always``; sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(torch.tensor(e.token_ids), minlength=vocab)
    for t in always:
        counts[t] = counts.max() + 1
    order = torch.argsort(-counts, stable=True)                    # ties: smaller id first
    return order[:size].sort().values


def examples_from_records(records) -> list[Example]:
    """Training examples from trace records: prompt + completion, loss on the completion (records with
    fewer than 2 completion tokens carry no block to learn from and are left out)."""
    return [Example(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids), r.domain) for r in records
            if len(r.completion_ids) >= 2]

"""Data-parallel training: two gloo ranks on CPU, set up the way torchrun sets them up (environment
variables only), train the same drafter as one process does, with the same loss curve shape."""

import json
import os
import socket

import torch
import torch.multiprocessing as mp

from dspark_core.drafters import build_drafter, drafter_config
from dspark_core.training.train import TrainConfig, train_drafter
from test_train import _learnable_target_and_data

CFG = TrainConfig(steps=60, batch_size=4, anchors_per_seq=16, lr=3e-3, checkpoint_every=20)


def _fresh_model(runner):
    return build_drafter(drafter_config("dspark", runner.arch, "tiny", block_size=4), runner, seed=0)


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    """One torchrun-like rank: only the environment tells train_drafter that it is distributed."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    target, train, _ = _learnable_target_and_data()
    model = _fresh_model(target.runner)
    calls = []
    res = train_drafter(target.runner, model, train, CFG, os.path.join(folder, "ckpt"), "fp",
                        callback=lambda step, m: calls.append(step), progress=False)
    torch.save({"state": model.state_dict(), "history": res.history, "callback_steps": calls,
                "group_left": not torch.distributed.is_initialized()}, os.path.join(folder, f"rank{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_train_like_one_process(tmp_path):
    """Deterministic (seeded data, init, batch order and per-rank anchors). DDP with the global batch
    split over 2 ranks follows the single-process curve: the final losses agree within 0.3 (a margin
    several times their gap in this setup) and both curves fall by > 0.8 from a start near 3.7."""
    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for (name, a), (_, b) in zip(ranks[0]["state"].items(), ranks[1]["state"].items()):
        assert torch.equal(a, b), f"ranks disagree on {name}"
    assert ranks[0]["history"] == ranks[1]["history"]           # metrics are all-reduced: one curve
    assert ranks[0]["callback_steps"] == list(range(1, CFG.steps + 1)) and ranks[1]["callback_steps"] == []
    assert all(r["group_left"] for r in ranks)                  # the group train_drafter made is gone

    ckpt = tmp_path / "ckpt"                                    # rank 0 wrote it; it holds the trained weights
    assert [h["step"] for h in json.loads((ckpt / "history.json").read_text())] == list(range(1, CFG.steps + 1))
    saved = torch.load(ckpt / "train_state.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], v) for k, v in ranks[0]["state"].items() if k in saved)

    target, train, _ = _learnable_target_and_data()
    single = train_drafter(target.runner, _fresh_model(target.runner), train, CFG, progress=False).history
    ddp = ranks[0]["history"]

    def mean_loss(hist):
        return sum(h["loss"] for h in hist) / len(hist)
    for curve in (single, ddp):
        assert mean_loss(curve[:5]) - mean_loss(curve[-5:]) > 0.8, curve
    assert abs(mean_loss(single[-10:]) - mean_loss(ddp[-10:])) < 0.3, (single[-10:], ddp[-10:])
    assert sum(h["supervised_slots"] for h in ddp) > 0.8 * sum(h["supervised_slots"] for h in single)

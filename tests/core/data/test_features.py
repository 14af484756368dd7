"""Target features captured while bootstrap generates: they equal a prefill's, training reads them instead of
running the target, and held-out sequences are never stored."""

from __future__ import annotations

import hashlib

import pytest
import torch

from dspark_core.engine.plain_batch import BatchRequest, generate_batch
from dspark_core.data.bootstrap import BootstrapConfig, bootstrap_traces, training_records
from dspark_core.data.features import NO_LSE, FeatureCapture, FeatureStore, sequence_key, training_taps
from dspark_core.training.losses import LossConfig
from dspark_core.drafters import build_drafter, drafter_config
from dspark_core.engine.sampling import SamplingParams
from dspark_core.training.train import FeatureSource, TrainConfig, examples_from_records, train_drafter
from tiny_models import tiny_target

VOCAB = 48
TAPS = (0, 1, 2)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=4, seed=3)


def _requests(n: int, temperature: float = 1.0):
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(temperature=temperature, max_new_tokens=int(torch.randint(1, 12, (1,), generator=g)))
        reqs.append(BatchRequest(i, prompt, params, torch.Generator().manual_seed(100 + i)))
    return reqs


def test_captured_features_equal_a_prefill_and_leave_the_tokens_unchanged(target, tmp_path):
    store = FeatureStore(tmp_path / "features")
    capture = FeatureCapture(store, TAPS)
    with_capture = generate_batch(target.runner, _requests(7), batch_size=3, capture=capture)
    without = generate_batch(target.runner, _requests(7), batch_size=3)
    assert sorted((r.key, r.token_ids) for r in with_capture) == sorted((r.key, r.token_ids) for r in without)
    assert capture.stored == 7
    source = FeatureSource(target.runner, TAPS, cache=False)
    for res in with_capture:
        ids = res.prompt_ids + res.token_ids
        P, S = len(res.prompt_ids), len(ids)
        have, taps, last, lse = store.get(ids)
        assert have == TAPS and taps.shape[0] == last.shape[0] == lse.shape[0] == S
        ref_taps, ref_last, ref_lse = source.get(0, ids)
        # every position but the last (never fed back): batched decode steps agree with one prefill
        torch.testing.assert_close(taps[:S - 1], ref_taps[:S - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last[:S - 1], ref_last[:S - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[P:S - 1], ref_lse[P:S - 1], atol=1e-4, rtol=1e-4)
        assert (lse[:P] == NO_LSE).all() and lse[S - 1] == NO_LSE and (taps[S - 1] == 0).all()


def test_feature_source_reads_the_store_slices_prefixes_and_recomputes_what_is_missing(target, tmp_path):
    store = FeatureStore(tmp_path / "features")
    capture = FeatureCapture(store, TAPS)
    res = max(generate_batch(target.runner, _requests(5), batch_size=2, capture=capture),
              key=lambda r: len(r.token_ids))
    ids = res.prompt_ids + res.token_ids
    src = FeatureSource(target.runner, (0, 2), store=store)
    taps, last, lse = src.get(0, ids, (2,))
    assert src.loaded == 1 and src.computed == 0
    ref = FeatureSource(target.runner, (0, 2), cache=False).get(0, ids, (2,))
    torch.testing.assert_close(taps[:-1], ref[0][:-1], atol=1e-4, rtol=1e-4)
    # a sequence cut to max_seq_len reads the prefix of the stored whole
    cut = ids[:len(ids) - 2]
    taps_cut, _, lse_cut = src.get(1, cut, source_ids=ids)
    assert src.loaded == 2 and taps_cut.shape[0] == len(cut)
    torch.testing.assert_close(lse_cut, lse[:len(cut)])
    # taps the store lacks, an unknown sequence, a file holding other tokens: computed by the target
    FeatureSource(target.runner, (3,), store=store).get(0, ids)
    other = FeatureSource(target.runner, TAPS, store=store)
    other.get(0, [5, 6, 7])
    wrong = store.path([9, 9])                 # a file under the key of [9, 9] that holds other tokens
    wrong.parent.mkdir(parents=True, exist_ok=True)
    store.path(ids).rename(wrong)
    other.get(1, [9, 9])
    assert other.loaded == 0 and other.computed == 2
    assert sequence_key([1, 2]) != sequence_key([2, 1])


def test_training_from_stored_features_matches_training_from_the_target(target, tmp_path):
    store = FeatureStore(tmp_path / "features")
    taps = tuple(drafter_config("dspark", target.runner.arch, preset="tiny").target_layer_ids)
    capture = FeatureCapture(store, taps)
    results = generate_batch(target.runner, _requests(8, temperature=0.0), batch_size=4, capture=capture)
    from dspark_core.training.train import Example
    examples = [Example(r.prompt_ids + r.token_ids, len(r.prompt_ids)) for r in results if len(r.token_ids) >= 3]
    cfg = TrainConfig(steps=12, batch_size=2, anchors_per_seq=4, seed=0, autocast_bf16=False,
                      loss=LossConfig.preset("dspark"))
    losses = []
    for use_store in (False, True):
        dcfg = drafter_config("dspark", target.runner.arch, preset="tiny", block_size=3)
        model = build_drafter(dcfg, target.runner, seed=0)
        feats = FeatureSource(target.runner, taps, store=store if use_store else None)
        res = train_drafter(target.runner, model, examples, cfg, None, progress=False, features=feats)
        assert (feats.loaded, feats.computed) == ((len(examples), 0) if use_store else (0, len(examples)))
        losses.append([h["loss"] for h in res.history])
    assert losses[0] == pytest.approx(losses[1], rel=1e-3, abs=1e-4)


def _encode(text: str) -> list[int]:
    return [1 + b % (VOCAB - 1) for b in hashlib.sha1(text.encode()).digest()[:5]]


def test_bootstrap_stores_features_of_training_prompts_only(target, tmp_path):
    taps = training_taps(target.runner.arch)
    cfg = BootstrapConfig(("code",), per_domain=8, seed=0, batch_size=3, max_new_tokens=4, heldout_fraction=0.3,
                          feature_taps=taps)
    summary = bootstrap_traces(target, tmp_path, cfg, encode=_encode, progress=False)["code"]
    store = FeatureStore.for_target(tmp_path, target.fingerprint)
    train = examples_from_records(training_records(tmp_path, "code", "train", target.fingerprint))
    held = examples_from_records(training_records(tmp_path, "code", "heldout", target.fingerprint))
    assert train and held
    assert all(store.get(e.token_ids) is not None for e in train)
    assert all(not store.path(e.token_ids).exists() for e in held)
    assert summary["features_stored"] == summary["train"]

import pytest
import torch

from tiny_models import runner_for, tiny_hf_model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_runner_matches_hf_forward_through_prefill_decode_and_rollback(family):
    model = tiny_hf_model(family, seed=3)
    runner = runner_for(model)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (40,), generator=gen).tolist()
    cache = runner.new_cache(1, 8)          # deliberately small: exercises growth
    out = runner.forward(cache, torch.tensor([seq[:10]]), logits="all")
    torch.testing.assert_close(out.logits[0], hf_logits(model, seq[:10]), rtol=1e-4, atol=1e-4)
    # verify-style chunk of 5, roll back 3 of them, continue with different tokens
    out = runner.forward(cache, torch.tensor([seq[10:15]]), logits="all")
    torch.testing.assert_close(out.logits[0], hf_logits(model, seq[:15])[10:], rtol=1e-4, atol=1e-4)
    cache.truncate(0, 12)
    alt = [7, 8, 9]
    out = runner.forward(cache, torch.tensor([alt]), logits="all")
    torch.testing.assert_close(out.logits[0], hf_logits(model, seq[:12] + alt)[12:], rtol=1e-4, atol=1e-4)
    for t in seq[15:25]:                    # single-token decode after the rollback
        prefix = seq[:12] + alt
        out = runner.forward(cache, torch.tensor([[t]]), logits="all")
        prefix = prefix + [t]
        alt = alt + [t]
    torch.testing.assert_close(out.logits[0, -1], hf_logits(model, prefix)[-1], rtol=1e-4, atol=1e-4)


def test_taps_are_raw_layer_outputs():
    model = tiny_hf_model("llama", seed=1)
    runner = runner_for(model)
    ids = list(range(1, 12))
    out = runner.forward(runner.new_cache(1, 32), torch.tensor([ids]), taps=(-1, 0, 2), logits="none")
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    d = model.config.hidden_size
    for i, layer in enumerate((-1, 0, 2)):
        torch.testing.assert_close(out.taps[0, :, i * d:(i + 1) * d], hs[layer + 1][0], rtol=1e-4, atol=1e-5)


def test_tap_validation_rejects_final_layer_and_unsorted():
    runner = runner_for(tiny_hf_model("llama"))
    with pytest.raises(ValueError, match="strictly increasing"):
        runner.validate_taps((2, 1))
    with pytest.raises(ValueError, match="final layer"):
        runner.validate_taps((3,))


def test_batched_ragged_rows_match_single_rows():
    model = tiny_hf_model("qwen3", seed=2)
    runner = runner_for(model)
    a, b = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    cache = runner.new_cache(2, 16)
    runner.forward(cache, torch.tensor([a]), rows=[0])
    runner.forward(cache, torch.tensor([b]), rows=[1])
    # one batched step with different lengths per row, padded to T = 3; row 1 keeps only 1 token
    out = runner.forward(cache, torch.tensor([[1, 2, 3], [4, 0, 0]]), logits="all")
    cache.truncate(1, len(b) + 1)
    torch.testing.assert_close(out.logits[0], hf_logits(model, a + [1, 2, 3])[-3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits[1, 0], hf_logits(model, b + [4])[-1], rtol=1e-4, atol=1e-4)
    out = runner.forward(cache, torch.tensor([[5], [6]]), logits="all")
    torch.testing.assert_close(out.logits[1, 0], hf_logits(model, b + [4, 6])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits[0, 0], hf_logits(model, a + [1, 2, 3, 5])[-1], rtol=1e-4, atol=1e-4)


def test_batched_step_over_a_subset_of_rows_writes_only_those_rows():
    """A batched step over some cache rows, in any order (a request between steps sits out): each
    listed row gets its keys/values at its own positions, the row left out keeps its cache untouched."""
    model = tiny_hf_model("llama", seed=3)
    runner = runner_for(model)
    seqs = [[3, 4, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15]]
    cache = runner.new_cache(3, 16)
    for row, ids in enumerate(seqs):
        runner.forward(cache, torch.tensor([ids]), rows=[row])
    k1, v1 = cache.k[:, 1].clone(), cache.v[:, 1].clone()
    out = runner.forward(cache, torch.tensor([[20, 21], [22, 23]]), rows=[2, 0], logits="all")
    torch.testing.assert_close(out.logits[0], hf_logits(model, seqs[2] + [20, 21])[-2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits[1], hf_logits(model, seqs[0] + [22, 23])[-2:], rtol=1e-4, atol=1e-4)
    assert cache.lengths == [7, 3, 6]
    assert torch.equal(cache.k[:, 1], k1) and torch.equal(cache.v[:, 1], v1)
    out = runner.forward(cache, torch.tensor([[24], [25], [26]]), logits="all")    # all rows again
    for row, nxt in zip(range(3), ([3, 4, 5, 6, 7, 22, 23, 24], [9, 10, 11, 25], [12, 13, 14, 15, 20, 21, 26])):
        torch.testing.assert_close(out.logits[row, 0], hf_logits(model, nxt)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths", [[4, 1, 2], [1, 1, 3, 1, 1]])   # the second: anchors and drafts attend apart
def test_packed_ragged_rows_match_unpadded_rows_and_skip_the_padding(lengths):
    """``lengths``: a batched step where row b holds only its first lengths[b] tokens gives each row
    the logits and taps of that row alone, writes no padding into the cache (a row grows by its own
    length), and the next step continues from there."""
    model = tiny_hf_model("qwen3", seed=6)
    runner = runner_for(model)
    seqs = [[3, 4, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15], [16, 17], [18, 19, 20, 21, 22, 23]][:len(lengths)]
    cache = runner.new_cache(len(seqs), 32)
    for row, ids in enumerate(seqs):
        runner.forward(cache, torch.tensor([ids]), rows=[row])
    step = torch.tensor([[20 + 4 * b + j if j < n else 0 for j in range(max(lengths))]
                         for b, n in enumerate(lengths)])
    out = runner.forward(cache, step, taps=(-1, 1), logits="all", lengths=lengths)
    assert cache.lengths == [len(q) + n for q, n in zip(seqs, lengths)]
    # the packed layout holds the same values, row b's at offsets[b], and leaves the cache the same
    for row, q in enumerate(seqs):
        cache.truncate(row, len(q))
    packed = runner.forward(cache, step, taps=(-1, 1), logits="all", lengths=lengths, packed=True)
    assert cache.lengths == [len(q) + n for q, n in zip(seqs, lengths)]
    ragged = sum(lengths) < len(lengths) * max(lengths)
    assert (packed.logits.shape[0] == sum(lengths)) if ragged else packed.offsets is None
    for row, n in enumerate(lengths):
        assert torch.equal(packed.row(packed.logits, row, n), out.row(out.logits, row, n))
        assert torch.equal(packed.row(packed.taps, row, n), out.taps[row, :n])
    d = model.config.hidden_size
    for row, n in enumerate(lengths):
        full = seqs[row] + step[row, :n].tolist()
        torch.testing.assert_close(out.logits[row, :n], hf_logits(model, full)[-n:], rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            hs = model(torch.tensor([full]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(out.taps[row, :n, :d], hs[0][0, -n:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.taps[row, :n, d:], hs[2][0, -n:], rtol=1e-4, atol=1e-5)
    nxt = [[40 + b] for b in range(len(seqs))]
    last = runner.forward(cache, torch.tensor(nxt), logits="last")
    for row, n in enumerate(lengths):
        full = seqs[row] + step[row, :n].tolist() + nxt[row]
        torch.testing.assert_close(last.logits[row, 0], hf_logits(model, full)[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="lengths"):
        runner.forward(cache, step, lengths=[0] + lengths[1:])


@pytest.mark.parametrize("rows, lengths", [([[3, 4, 5], [9, 10], [12, 13, 14, 15]], [1, 1, 1]),   # no row drafts
                                           ([[3, 4, 5, 6, 7]], [2])])                         # one padded row
def test_ragged_edge_layouts_match_the_same_tokens_sent_unpadded(rows, lengths):
    """Two layouts of ``lengths`` the engine does not send but the contract allows: a T > 1 step where
    every row holds only its anchor, and a single row padded on the right. Each gives the logits, cache
    lengths and next step of the real tokens sent alone."""
    model = tiny_hf_model("qwen3", seed=6)
    runner = runner_for(model)
    caches = [runner.new_cache(len(rows), 32) for _ in range(2)]
    for cache in caches:
        for row, ids in enumerate(rows):
            runner.forward(cache, torch.tensor([ids]), rows=[row])
    T = max(lengths) + 2
    step = torch.tensor([[40 + 3 * b + j for j in range(T)] for b in range(len(rows))])
    ragged = runner.forward(caches[0], step, logits="all", lengths=lengths, packed=True)
    alone = [runner.forward(caches[1], step[b:b + 1, :n], rows=[b], logits="all") for b, n in enumerate(lengths)]
    assert caches[0].lengths == caches[1].lengths == [len(q) + n for q, n in zip(rows, lengths)]
    for b, n in enumerate(lengths):
        torch.testing.assert_close(ragged.row(ragged.logits, b, n), alone[b].logits[0], rtol=1e-5, atol=1e-5)
        full = rows[b] + step[b, :n].tolist()
        torch.testing.assert_close(alone[b].logits[0], hf_logits(model, full)[-n:], rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([[60 + b] for b in range(len(rows))])
    a, b = (runner.forward(cache, nxt, logits="last").logits for cache in caches)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_runner_stays_close_to_fp32():
    model = tiny_hf_model("llama", seed=4)
    ids = torch.tensor([list(range(5, 25))])
    f32 = runner_for(model).forward(runner_for(model).new_cache(), ids).logits
    r16 = runner_for(model, torch.bfloat16)
    b16 = r16.forward(r16.new_cache(), ids).logits
    assert b16.dtype == torch.float32          # logits are always returned in fp32
    assert (b16 - f32).abs().max() < 0.1 * f32.abs().max()


def test_bad_input_shape_is_explained():
    runner = runner_for(tiny_hf_model("llama"))
    with pytest.raises(ValueError, match=r"\[batch, T\]"):
        runner.forward(runner.new_cache(), torch.tensor([1, 2, 3]))


def test_kv_cache_rows_join_and_leave_without_losing_contents():
    """The row pool: rows added into free slots start empty, kept rows keep their keys/values and
    lengths under their new numbers (sorted or not), and growing the pool or the capacity keeps them."""
    from dspark_core.model.layers import KVCache
    c = KVCache(2, 0, 1, 2, 4, torch.float32)
    def fill(row, val, n):
        c.k[:, row, :, :n] = val
        c.v[:, row, :, :n] = -val
        c.lengths[row] = n
    for i in range(5):                               # pool grows past its first size
        (r,) = c.add_rows(1)
        fill(r, float(i + 1), i % 4 + 1)
    assert c.batch == 5 and c.k.shape[1] == 5
    c.keep_rows([1, 3, 4])                           # rows 1, 3, 4 become 0, 1, 2
    assert c.lengths == [2, 4, 1]
    for j, val in enumerate((2.0, 4.0, 5.0)):
        assert torch.all(c.k[:, j, :, :c.lengths[j]] == val) and torch.all(c.v[:, j, :, :c.lengths[j]] == -val)
    (r,) = c.add_rows(1)                             # a reused slot starts empty
    assert r == 3 and torch.all(c.k[:, 3] == 0) and c.lengths[3] == 0
    c.reserve(40)
    assert c.capacity >= 40 and torch.all(c.k[:, 1, :, :4] == 4.0)
    c.keep_rows([2, 0])                              # unsorted: renumbered in the given order
    assert c.lengths == [1, 2] and torch.all(c.k[:, 0, :, :1] == 5.0) and torch.all(c.v[:, 1, :, :2] == -2.0)
    with pytest.raises(ValueError, match="distinct rows"):
        c.keep_rows([0, 0])
    c.keep_rows([])
    assert c.batch == 0 and c.k.shape[1] == 0


def test_attention_accepts_an_output_layout_other_than_contiguous(monkeypatch):
    """CUDA's SDPA kernels may return [B, H, T, D] with another memory layout (it broke the first H200
    run with a .view); the grouped-query fold must not depend on the layout, and a mask folded once per
    forward gives the same result as one folded per call."""
    import torch.nn.functional as F
    from dspark_core.model import layers
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g),
               torch.randn(2, 2, 5, 8, generator=g))
    mask = torch.rand(2, 1, 3, 5, generator=g) > 0.3
    mask[..., 0] = True
    expected = layers.attention(q, k, v, mask)
    folded = layers.attention(q, k, v, mask.repeat(1, 1, 3, 1))
    assert torch.equal(folded, expected)
    real = F.scaled_dot_product_attention

    def strided(*a, **kw):                  # same values, transposed storage as a fused kernel may give
        out = real(*a, **kw)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", strided)
    assert torch.equal(layers.attention(q, k, v, mask), expected)


def test_cuda_targets_keep_attention_off_cudnn(monkeypatch):
    """cuDNN's SDPA builds a plan per new key length (each costing several decoding steps), and
    speculative decoding changes key lengths every step: a CUDA target switches it off for the process
    unless DSPARK_CUDNN_SDPA=1; a CPU target leaves the setting alone."""
    import torch
    from dspark_core.model.layers import keep_attention_off_cudnn
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.delenv("DSPARK_CUDNN_SDPA", raising=False)
        assert keep_attention_off_cudnn("cpu") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv("DSPARK_CUDNN_SDPA", "1")
        assert keep_attention_off_cudnn("cuda") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.delenv("DSPARK_CUDNN_SDPA")
        assert keep_attention_off_cudnn("cuda:0") is True and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear_and_rows_do_not_depend_on_the_batch(dtype, monkeypatch):
    # the packed path itself, whatever this host's measured choice (set by any target loaded before)
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "1")
    from dspark_core.model.layers import Linear, packing_enabled
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(9, 40, generator=gen).to(dtype)
    lin = Linear(w, b)
    assert (lin.packed is not None) == packing_enabled("cpu", dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(lin(x).float(), torch.nn.functional.linear(x, w, b).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lin(x[None]), lin(x)[None])                     # any leading shape
    for m in (1, 2, 5):                                                        # row 0 alone or among others
        assert torch.equal(lin(x[:m])[0], lin(x)[0])
    r = torch.randn(9, 96, generator=gen).to(dtype)
    torch.testing.assert_close(Linear(w).add_to(r, x).float(), (r + x @ w.t()).float(), rtol=tol, atol=tol)


def test_packing_can_be_switched_off_and_the_runner_then_gives_the_same_logits(monkeypatch):
    model = tiny_hf_model("qwen2", seed=5)                     # qkv bias: the packed path carries it
    seq = list(range(3, 20))
    packed = runner_for(model)
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "0")
    plain = runner_for(model)
    assert plain.layers[0].qkv.packed is None and plain.head.packed is None
    outs = [r.forward(r.new_cache(1, 32), torch.tensor([seq]), logits="all").logits for r in (packed, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_transposed_kernel_gives_the_runner_the_same_logits(monkeypatch):
    model = tiny_hf_model("qwen2", seed=6)                     # qkv bias: the transposed path carries it
    seq = list(range(3, 20))
    monkeypatch.setenv("DSPARK_LINEAR_KERNEL", "linear")
    plain = runner_for(model)
    monkeypatch.setenv("DSPARK_LINEAR_KERNEL", "transposed")
    transposed = runner_for(model)
    assert transposed.layers[0].qkv.kernel == "transposed" and transposed.head.kernel == "transposed"
    outs = [r.forward(r.new_cache(1, 32), torch.tensor([seq]), logits="all").logits for r in (plain, transposed)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    cache = transposed.new_cache(1, 32)                        # one token at a time: the decoding path
    steps = [transposed.forward(cache, torch.tensor([[t]]), logits="all").logits[0, 0] for t in seq]
    torch.testing.assert_close(torch.stack(steps), outs[0][0], rtol=1e-4, atol=1e-4)


def test_inference_linear_trains_like_nn_linear_and_repacks_after_a_step(monkeypatch):
    monkeypatch.setenv("DSPARK_PACKED_LINEAR", "1")              # the packed path, whatever the host chose
    from dspark_core.model.layers import InferenceLinear, pack_linears
    torch.manual_seed(0)
    net = pack_linears(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    assert all(type(m) is InferenceLinear for m in (net[0], net[2]))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        before = net(x)
    loss = net(x).square().sum()                               # gradients flow as through nn.Linear
    loss.backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    with torch.no_grad():
        after = net(x)
        ref = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, net[0].weight, net[0].bias)),
                                         net[2].weight, net[2].bias)
    assert not torch.allclose(before, after)                   # the packed copy followed the update
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)

"""Shared transformer building blocks: RMSNorm, rotary embeddings, attention, a growable KV cache."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; torch's kernel accumulates in fp32 for bf16 inputs, as Llama/Qwen do."""
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class Rotary:
    """Precomputed cos/sin tables for rotary position embeddings.

    ``inv_freq`` and ``scaling`` come from the target's own rotary module so that every HF rope
    variant (default, llama3, yarn, ...) is reproduced exactly.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, max_positions: int = 4096,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.inv_freq = inv_freq.detach().float().to(device)
        self.scaling = float(scaling)
        self.dtype = dtype
        self.device = torch.device(device)
        self._build(max_positions)

    @classmethod
    def default(cls, head_dim: int, theta: float, **kw) -> "Rotary":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return cls(inv_freq, 1.0, **kw)

    def _build(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.inv_freq.shape[0]
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device)
        self.cos = (emb.cos() * self.scaling).to(self.dtype)  # [max_positions, head_dim]
        # sin with rotate_half's sign folded in: rope(x) = x * cos + roll(x, D/2) * sin_signed
        self.sin = (emb.sin() * self.scaling * sign).to(self.dtype)
        self.max_positions = n

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "Rotary":
        return Rotary(self.inv_freq, self.scaling, self.max_positions, dtype, device or self.device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for integer ``positions`` of any shape -> [*positions.shape, head_dim]."""
        need = int(positions.max()) + 1
        if need > self.max_positions:
            self._build(max(need, 2 * self.max_positions))
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split (HF) layout; cos/sin from :meth:`Rotary.tables` broadcast to x.

    rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * sign; the sign lives in the sin table.
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


_PACK_OFF = ("0", "false", "no", "off")


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 matmuls run natively on ``device``: on CUDA, and on CPUs with AVX512-BF16 or AMX.

    Elsewhere (an AVX2-only CPU, for one) PyTorch emulates them: a one-token forward can still gain from
    reading half the weight bytes, but the multi-token forwards that speculation, batching, prefill and
    training run are slower than fp32 (docs/engine.md, "dtypes")."""
    if torch.device(device).type == "cuda":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# The matmul kernels :class:`Linear` can run a frozen weight through (see model/kernels.py):
#   "linear":     ``F.linear`` on the weight as stored ([out, in]);
#   "packed":     a copy prepacked for oneDNN (CPU; fp32, or bf16 where bf16 matmuls are native);
#   "transposed": ``x @ W^T`` from a contiguous [in, out] copy (one plain GEMM, no transposed operand).
KERNELS = ("linear", "packed", "transposed")
KERNEL_NAMES = {"linear": "F.linear", "packed": "prepacked", "transposed": "transposed"}

# the kernels chosen in this process by (device type, dtype), for one-row calls and for calls of several
# rows: see model/kernels.py
_KERNEL: dict[tuple[str, torch.dtype], tuple[str, str]] = {}


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :class:`Linear` can prepack here: CPU, fp32 (or bf16 where bf16 matmuls are native: on an
    AVX2-only CPU oneDNN refuses to pack a bf16 weight) and a torch with oneDNN."""
    if dtype == torch.bfloat16 and not bf16_is_fast(device):
        return False
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def kernels_supported(device: torch.device | str, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels :class:`Linear` can run here: all three where :func:`packing_supported`; on CUDA and
    elsewhere only ``F.linear`` (cuBLAS takes the stored layout as it is)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return ("linear",)
    return KERNELS if packing_supported(device, dtype) else ("linear", "transposed")


def set_kernel(device: torch.device | str, dtype: torch.dtype, kernel: str, multi_kernel: str | None = None) -> None:
    """Record this process's kernel for ``device``/``dtype`` (what
    :func:`~dspark_core.model.kernels.choose_kernel` measured), and another for calls of several rows;
    later :class:`Linear` objects follow it."""
    for k in (kernel, multi_kernel or kernel):
        if k not in KERNELS:
            raise ValueError(f"unknown linear kernel {k!r}; one of {', '.join(KERNELS)}")
    _KERNEL[(torch.device(device).type, dtype)] = (kernel, multi_kernel or kernel)


def kernel_from_env() -> str | None:
    """The kernel the environment forces: ``DSPARK_LINEAR_KERNEL`` (linear, packed or transposed), else
    ``DSPARK_PACKED_LINEAR`` (1: packed, 0: linear); None when neither is set."""
    name = os.environ.get("DSPARK_LINEAR_KERNEL", "").strip().lower()
    if name:
        if name not in KERNELS:
            raise ValueError(f"DSPARK_LINEAR_KERNEL={name!r} is not a kernel; use one of {', '.join(KERNELS)}")
        return name
    env = os.environ.get("DSPARK_PACKED_LINEAR", "").strip().lower()
    if env:
        return "linear" if env in _PACK_OFF else "packed"
    return None


def linear_kernels(device: torch.device | str, dtype: torch.dtype) -> tuple[str, str]:
    """The kernels :class:`Linear` uses here for one-row calls and for calls of several rows: the
    environment's (:func:`kernel_from_env`, for both), else those measured for this host when the target
    was loaded, else prepacked where it can be; a kernel not supported here falls back to ``F.linear``."""
    env = kernel_from_env()
    pair = (env, env) if env else _KERNEL.get((torch.device(device).type, dtype), ("packed", "packed"))
    ok = kernels_supported(device, dtype)
    return tuple(k if k in ok else "linear" for k in pair)


def linear_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """The kernel :class:`Linear` uses here for a one-row call (see :func:`linear_kernels`)."""
    return linear_kernels(device, dtype)[0]


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :class:`Linear` prepacks weights here, for any row count (see :func:`linear_kernels`)."""
    return "packed" in linear_kernels(device, dtype)


class Linear:
    """``y = x @ weight.T (+ bias)`` for a frozen weight, through the kernel measured fastest on this host.

    ``F.linear`` reorders its weight into oneDNN's blocked layout on every call; a decoding step is a
    handful of tokens, so on CPU that reorder can set the step's cost. Packing once (as torch's own CPU
    freezing pass does) removes it from every call; a contiguous transposed copy lets the plain GEMM read
    the weight in the order it multiplies it. Which is fastest is a property of the host, the dtype and
    the rows per call (model/kernels.py measures it at load): one kernel may win a one-token step and
    another a verify block, and then both copies are kept and each call takes the one for its row count.
    Whether a row's result depends on how many rows share the call depends on the kernel and the shape
    (the tests check 1 to 33 rows on a small one; docs/engine.md has what SmolLM2's shapes do). Elsewhere
    (CUDA, other dtypes, no oneDNN, or a pack whose self-check fails) it is ``F.linear``. Only the copies
    the kernels read are kept.
    ``pack``: True/False forces prepacked/``F.linear``; ``kernel`` names one (``multi_kernel``: another
    for calls of two rows or more); with neither, this host's choice. ``rows_hint``: the batch size oneDNN
    tunes a packed layout for (it stays right for any other)."""

    __slots__ = ("weight", "bias", "packed", "wt", "kernel", "multi_kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool | None = None,
                 rows_hint: int = 8, kernel: str | None = None, multi_kernel: str | None = None):
        self.bias = bias
        self.packed = self.wt = None
        if kernel is None:
            if pack is None:
                kernel, multi_kernel = linear_kernels(weight.device, weight.dtype)
            else:
                kernel = "packed" if pack else "linear"
        wanted = {kernel, multi_kernel or kernel}
        if "packed" in wanted and packing_supported(weight.device, weight.dtype):
            self.packed = _pack(weight, bias, rows_hint)
        if "transposed" in wanted:
            self.wt = weight.detach().t().contiguous()                   # [in, out]
        self.kernel, self.multi_kernel = (self._have(k) for k in (kernel, multi_kernel or kernel))
        self.weight = weight if "linear" in (self.kernel, self.multi_kernel) else None

    def _have(self, kernel: str) -> str:
        """``kernel`` if its copy exists, else ``F.linear`` (a pack that failed its self-check)."""
        return kernel if (kernel == "packed" and self.packed is not None) or \
            (kernel == "transposed" and self.wt is not None) else "linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel if x.numel() == x.shape[-1] else self.multi_kernel
        if kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if kernel == "transposed":
            if x.dim() == 2:
                return torch.mm(x, self.wt) if self.bias is None else torch.addmm(self.bias, x, self.wt)
            y = torch.matmul(x, self.wt)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` for 2-D ``x`` (the residual add fused into the matmul where it can be)."""
        kernel = self.kernel if x.shape[0] == 1 else self.multi_kernel
        if self.bias is None and kernel != "packed":
            return torch.addmm(residual, x, self.wt if kernel == "transposed" else self.weight.t())
        return residual + self(x)


class InferenceLinear(nn.Linear):
    """An ``nn.Linear`` that, when no gradient is being recorded, multiplies through a :class:`Linear`
    (its weight prepacked or transposed on CPU, as this host measured fastest); with gradients on it is
    ``nn.Linear``. The packed copy is keyed on the
    weight's storage, version, dtype and device, so an optimizer step or ``.to()`` re-packs it lazily.
    Installed by :func:`pack_linears` (a class swap: parameters, ``state_dict`` and training unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, None if self.bias is None else self.bias._version)
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            bias = None if self.bias is None else self.bias.detach()
            cached = (key, Linear(w.detach(), bias))
            self.__dict__["_packed"] = cached
        return cached[1](x)


def pack_linears(module: nn.Module) -> nn.Module:
    """Turn every ``nn.Linear`` inside ``module`` into an :class:`InferenceLinear` (in place) where this
    host's kernels for its weight (:func:`linear_kernels`) are not plain ``F.linear``; returns ``module``."""
    for m in module.modules():
        if type(m) is nn.Linear and linear_kernels(m.weight.device, m.weight.dtype) != ("linear", "linear"):
            m.__class__ = InferenceLinear
    return module


def _pack(weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> torch.Tensor | None:
    """oneDNN-packed ``weight``, or None where packing fails or does not reproduce ``F.linear``."""
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
            probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=torch.float32).view(3, -1).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "").float()
            want = F.linear(probe, weight, bias).float()
    except (RuntimeError, NotImplementedError):
        return None
    tol = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    return packed if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1))) else None


def keep_attention_off_cudnn(device: torch.device | str) -> bool:
    """On CUDA, take SDPA's cuDNN backend out of this process's choices (once, when a target is loaded).

    Speculative decoding attends over key lengths that change from one call to the next (a drafter's
    growing context, a batch padded to its longest row, a catch-up over the tokens of a plain spell).
    cuDNN's attention builds an execution plan for every shape it has not seen (in torch versions where
    cuDNN is a default SDPA choice), and one plan costs several whole decoding steps, while the flash and
    memory-efficient kernels cost the same at any key length. ``DSPARK_CUDNN_SDPA=1`` keeps cuDNN.
    Returns whether it was switched off."""
    if torch.device(device).type != "cuda" or os.environ.get("DSPARK_CUDNN_SDPA") == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = may attend) -> additive mask (0 / -inf) in ``dtype``. Built once per forward
    and passed to every layer: SDPA otherwise turns a bool mask into this in each call, once per layer;
    the attention output is bit-identical either way."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """Grouped-query attention. q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: bool or additive
    (:func:`additive_mask`) [B, 1, T, S], or None.

    The query heads that share a KV head are folded into the query-length axis, so K/V are never
    repeated (repeat_interleave would copy them at every call). ``causal`` (T == S, no
    mask) uses SDPA's causal kernel with the K/V heads repeated instead.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    n_rep = H // Hkv
    if causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    qg = q.reshape(B, Hkv, n_rep * T, D)                  # head h -> kv head h // n_rep
    if mask is not None and mask.shape[2] != n_rep * T:   # callers may pass it folded already (once per forward)
        mask = mask.repeat(1, 1, n_rep, 1)               # [B, 1, n_rep * T, S]
    # reshape, not view: CUDA's fused kernels may return the output in another memory layout
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, H, T, D)


def packed_block_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, ctx_mask: torch.Tensor, block: int) -> torch.Tensor:
    """Attention of many packed blocks (training): each block sees its allowed context and its own slots.

    q [B, H, T, D] with T = A * block (A blocks of ``block`` slots, one after another); ctx_k/ctx_v
    [B, Hkv, S, D] context keys/values; k/v [B, Hkv, T, D] the slots' own keys/values; ctx_mask bool
    [B, 1, T, S] (True = may attend). Equal to :func:`attention` over [context ; slots] with a mask that
    adds each block's own slots (bidirectional), but the block-diagonal part is computed as A small
    ``block`` x ``block`` products instead of a dense T x T one: at 128 blocks of 7 the dense layout
    spent 99 % of its slot-to-slot scores on masked pairs.
    """
    B, H, T, D = q.shape
    Hkv, S = ctx_k.shape[1], ctx_k.shape[2]
    A, n_rep = T // block, H // Hkv
    q5 = q.reshape(B, Hkv, n_rep, T, D) * D ** -0.5                   # head h -> kv head h // n_rep
    s_ctx = torch.einsum("bhrtd,bhsd->bhrts", q5, ctx_k)               # [B, Hkv, r, T, S]
    s_ctx = s_ctx.masked_fill(~ctx_mask[:, :, None], float("-inf"))
    kb, vb = k.reshape(B, Hkv, A, block, D), v.reshape(B, Hkv, A, block, D)
    s_own = torch.einsum("bhragd,bhaed->bhrage", q5.reshape(B, Hkv, n_rep, A, block, D), kb)
    scores = torch.cat([s_ctx, s_own.reshape(B, Hkv, n_rep, T, block)], dim=-1)
    p = scores.float().softmax(-1).to(q.dtype)                         # every row sees its own slots: no NaN
    out = torch.einsum("bhrts,bhsd->bhrtd", p[..., :S], ctx_v)
    own = torch.einsum("bhrage,bhaed->bhragd", p[..., S:].reshape(B, Hkv, n_rep, A, block, block), vb)
    return (out + own.reshape(B, Hkv, n_rep, T, D)).reshape(B, H, T, D)


class KVCache:
    """Key/value buffers for ``n_layers`` layers, ``batch`` rows, with a committed length per row.

    Rolling back rejected tokens is O(1): ``truncate`` only moves the row's length; the stale entries
    beyond it are masked out of attention and overwritten by the next write.

    Rows live in a pool (``_k``/``_v`` hold room for more rows than are in use; ``k``/``v`` are views of
    the first ``batch`` rows), so continuous batching does not copy the whole cache whenever a request
    joins or leaves: a joining row reuses a free slot, and a leaving row only shifts the rows after it.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max(capacity, 16), head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=device)  # pool [layers, slots, kv_heads, cap, head_dim]
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self._rows = batch
        self._view()
        self.lengths = [0] * batch

    def _view(self) -> None:
        self.k = self._k[:, :self._rows]                            # [layers, batch, kv_heads, cap, head_dim]
        self.v = self._v[:, :self._rows]

    @property
    def capacity(self) -> int:
        return self._k.shape[3]

    @property
    def batch(self) -> int:
        return self._rows

    def reserve(self, needed: int) -> None:
        """Grow the buffers (amortised doubling) so that ``needed`` positions fit."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[:3] + (new_cap,) + old.shape[4:])
            grown[:, :self._rows, :, : old.shape[3]] = old[:, :self._rows]
            setattr(self, name, grown)
        self._view()

    def truncate(self, row: int, length: int) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def add_rows(self, n: int) -> list[int]:
        """Append ``n`` empty rows (continuous batching); returns their indices."""
        start = self._rows
        if start + n > self._k.shape[1]:                            # pool full: double it
            slots = max(start + n, 2 * self._k.shape[1], 4)
            for name in ("_k", "_v"):
                old = getattr(self, name)
                grown = old.new_zeros(old.shape[:1] + (slots,) + old.shape[2:])
                grown[:, :start] = old[:, :start]
                setattr(self, name, grown)
        else:
            self._k[:, start:start + n].zero_()
            self._v[:, start:start + n].zero_()
        self._rows = start + n
        self._view()
        self.lengths.extend([0] * n)
        return list(range(start, start + n))

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (finished requests leave the batch); kept rows are renumbered
        0..len(rows)-1 in the given order."""
        if any(not 0 <= r < self._rows for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"keep_rows needs distinct rows in [0, {self._rows}), got {rows}")
        if rows == sorted(rows):                                    # shift rows down in place
            for j, r in enumerate(rows):
                if r != j:
                    self._k[:, j] = self._k[:, r]
                    self._v[:, j] = self._v[:, r]
        else:
            idx = torch.tensor(rows, dtype=torch.long, device=self._k.device)
            kept_k, kept_v = self._k.index_select(1, idx), self._v.index_select(1, idx)
            self._k[:, :len(rows)] = kept_k
            self._v[:, :len(rows)] = kept_v
        self._rows = len(rows)
        self._view()
        self.lengths = [self.lengths[r] for r in rows]

"""Helpers shared by entry points: dtype/device choice, prompt encoding, generator creation."""

from __future__ import annotations

import torch

from dspark_core.model.layers import bf16_is_fast

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """'auto' picks bf16 where bf16 matmuls are native (:func:`bf16_is_fast`), else fp32."""
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32 or bfloat16")
    return DTYPES[name]


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for ``text``; with ``chat`` the tokenizer's chat template adds a generation prompt."""
    if not text or not text.strip():
        raise ValueError("the prompt is empty: give some text")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; drop --chat")
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text).input_ids)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (``[{"role", "content"}, ...]``) through the tokenizer's chat template, with
    the generation prompt added; a ValueError when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def make_generator(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g

"""Field limits shared by the HTTP API, the engine and the warehouse: defined once, here.

The warehouse stores token ids, ``top_k``, ``max_new_tokens`` and round counts in 32-bit ``INTEGER``
columns, so a trace record refuses larger values and the API refuses them at the door: a request the
server accepts always leaves a trace the warehouse can store. ``torch.Generator.manual_seed`` takes a
seed in ``[-2**63, 2**64)``; the API accepts exactly that range. Sampling values must be finite.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1                 # the warehouse's INTEGER columns
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_MAX = INT32_MAX
MAX_NEW_TOKENS_MAX = INT32_MAX
TEMPERATURE_MAX = 2.0                 # the API's bound, as OpenAI's

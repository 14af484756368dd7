"""The server on the real SmolLM2-135M target (fp32) with the trained code drafter from the drafters
benchmark (``$DSPARK_HOME/bench/drafters-*/dspark-code``), or, on a fresh machine where none was trained,
a seeded untrained DSpark drafter for that target (it drafts, mostly rejected): greedy output through
HTTP equals plain decoding either way."""

import openai
import pytest

from serving_helpers import plain_ids, serve

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def drafters_dir(dspark_home, smollm2, tmp_path_factory):
    found = sorted(dspark_home.glob("bench/drafters-*/dspark-code/config.json"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1].parent.parent
    from dspark_core.drafters import build_drafter, drafter_config, save_drafter
    root = tmp_path_factory.mktemp("fresh-drafters")
    cfg = drafter_config("dspark", smollm2.runner.arch, "default", block_size=4)
    save_drafter(build_drafter(cfg, smollm2.runner, seed=0), root / "code", smollm2.fingerprint)
    return root


def test_real_target_serves_code_losslessly_with_its_drafter(smollm2, drafters_dir, tmp_path):
    from serving.drafters import LocalSource
    source = LocalSource(drafters_dir, smollm2.runner, smollm2.fingerprint)
    server, state = serve(smollm2, source, tmp_path, domains=("code", "chat"), default_domain="chat",
                          policy="scheduled", max_batch=4)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    with server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r = c.completions.create(model=f"{smollm2.name}:code", prompt=prompt, max_tokens=32, temperature=0,
                                 extra_body={"return_token_ids": True})
        chat = c.chat.completions.create(model=smollm2.name, messages=msgs, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True})
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model=smollm2.name, messages=msgs, max_tokens=24,
                                                     temperature=0, stream=True))
    info = r.model_extra["dspark"]
    assert info["drafter"] == "dspark-code:local" and info["drafted"] > 0
    assert info["completion_token_ids"] == plain_ids(smollm2, smollm2.tokenizer(prompt).input_ids, 32)
    ids = smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat.model_extra["dspark"]["domain"] == "code"           # the classifier saw "Python function"
    assert chat.model_extra["dspark"]["completion_token_ids"] == plain_ids(smollm2, ids, 24)
    assert streamed == chat.choices[0].message.content


def test_incremental_detokenizing_matches_a_whole_decode(smollm2):
    """Streaming decodes only the new tokens each step; on the real tokenizer the text it builds, fed
    in uneven chunks, equals one decode of all the tokens, and what it returns only ever grows."""
    import random
    import types

    from dspark_core.engine.spec_batch import SpecRequest
    from dspark_core.engine.sampling import SamplingParams
    from serving.engine import Engine, _Track
    tok = smollm2.tokenizer
    fake = types.SimpleNamespace(tokenizer=tok)
    fake._decode = types.MethodType(Engine._decode, fake)
    texts = ["def f(x):\n    return  x ** 2  # square\n\n\nprint(f(3))",
             "Café au lait coûte 3,50 € — 中文字符 and emoji 🚀🔥 done.",
             " leading space, trailing space ", "\t\ttabs\nand  double  spaces... ?!"]
    rng = random.Random(0)
    for text in texts:
        ids = tok(text).input_ids
        spec = SpecRequest("k", [1], SamplingParams())
        tr = _Track(req=None, spec=spec, drafter=None)
        seen = ""
        i = 0
        while i < len(ids):
            i = min(len(ids), i + rng.randint(1, 5))
            spec.tokens = ids[:i]
            got = Engine._text_so_far(fake, tr)
            stable = got.rstrip("\ufffd")
            assert stable.startswith(seen.rstrip("\ufffd"))
            seen = got
        assert seen == tok.decode(ids, skip_special_tokens=True)

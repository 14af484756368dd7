"""Which domain (and so which drafter) serves a request.

In order: the request's ``domain`` field (extra body), a model-name suffix (``smollm2-135m-instruct:code``),
then a light keyword classifier over the prompt text, then the default domain. A named domain the server
does not serve falls back to the default domain (the request still succeeds; the response says so).
"""

from __future__ import annotations

import re

_CODE = re.compile(r"```|\bdef\s+\w+\s*\(|\bclass\s+\w+|\bimport\s+\w+|\bfunction\b|\breturn\b|\bpython\b|"
                   r"\bjavascript\b|\btypescript\b|\brust\b|\bjava\b|\bc\+\+|\bcode\b|\bprogram\b|\bcompile|"
                   r"\bbug\b|\bregex\b|\bsql\b|[{};]\s*$|==|->|\bdocstring\b", re.I | re.M)
_MATH = re.compile(r"\d+\s*[-+*/^=×÷]\s*\d+|\bsolve\b|\bequation|\bcalculate|\bcompute\b|\bsum of\b|\bhow many\b|"
                   r"\bintegral|\bderivative|\bprobability|\bmath|\bproduct of\b|\bremainder\b|\bpercent|"
                   r"\bfraction|\bprime\b|\bdivisible\b|\bsquare root\b", re.I)
_RULES = {"code": _CODE, "math": _MATH}


def classify(text: str, domains: list[str] | tuple[str, ...], default: str) -> str:
    """The served domain whose keyword rule matches most often; ``default`` when none matches."""
    scores = {d: len(rule.findall(text)) for d, rule in _RULES.items() if d in domains}
    best = max(scores.items(), key=lambda kv: kv[1], default=(default, 0))
    return best[0] if best[1] > 0 else default


def resolve_domain(model: str, domain_field: str | None, text: str, domains: list[str], default: str
                   ) -> tuple[str, str]:
    """(domain, how): how is "field", "model", "classifier", "default" or "unknown:<name>"."""
    suffix = model.split(":", 1)[1] if ":" in model else ""
    asked, how = (domain_field, "field") if domain_field else ((suffix, "model") if suffix else (None, ""))
    if asked:
        asked = asked.strip().lower()
        return (asked, how) if asked in domains else (default, f"unknown:{asked}")
    got = classify(text, domains, default)
    return got, ("classifier" if got != default else "default")


def base_model(model: str) -> str:
    return model.split(":", 1)[0]

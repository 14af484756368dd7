"""Route a prompt to the ``code``, ``math`` or ``chat`` domain from its text alone.

A transparent scoring rule, not a model: it has to run anywhere traces are prepared (no weights, no
network, microseconds per prompt) and its decisions have to be explainable in a review of where a
ShareGPT turn went. :func:`domain_scores` adds up weighted evidence for code (fenced blocks, source-like
lines, programming vocabulary) and for math (equations, arithmetic, LaTeX, quantity questions,
mathematical vocabulary); :func:`classify_prompt` picks the domain whose evidence clears its threshold
and beats the other's, else ``chat``. Tested on labelled prompts (tests/core/data/labelled_prompts.jsonl)
plus every HumanEval problem and generated math problems.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CODE_THRESHOLD = 2.0
MATH_THRESHOLD = 2.0

_FENCE = re.compile(r"```")
_SOURCE_LINE = re.compile(
    r"^\s*(def |class \w+[:(]|import |from \S+ import |#include|function\b|public |private |static |const |let |"
    r"var |return\b|if \(|for \(|while \(|SELECT |INSERT |UPDATE |CREATE TABLE|<\?php|<html|<div|@\w+\(|"
    r"print\(|console\.log|System\.out|fn |func |package |using |namespace |async |await |try:|except\b|elif\b|"
    r"\$ (pip|npm|git|docker|kubectl|sudo|cd|ls) )", re.MULTILINE | re.IGNORECASE)
_CODE_PUNCT = re.compile(r"(\w\(\)|\);|\{\s*$|^\s*\}|=>|->|::|!=|==|\+=|\[\]|</\w+>|\w\.\w+\(|\w+\[\w*\]\s*=|\\[.\w]|\{\d+,\d*\}|\w\+\+|;\s*$|\b(for|while|if|switch)\s*\([^)]*[<>=][^)]*\))",
                         re.MULTILINE)
# names of languages and tools, and words that hardly occur outside programming: strong evidence
_CODE_STRONG = re.compile(
    r"(?<!\w)(?:c\+\+|c#|\.net)(?!\w)|\b(python|javascript|typescript|java|golang|rust|kotlin|swift|php|ruby|"
    r"scala|perl|haskell|matlab|sql|mysql|postgres\w*|sqlite|mongodb|html|css|react|angular|vue|node\.?js|django|"
    r"flask|fastapi|spring boot|pandas|numpy|pytorch|tensorflow|keras|bash|shell script|powershell|regex|regexp|"
    r"api|apis|json|yaml|xml|git|docker\w*|kubernetes|k8s|vba|macro|solidity|smart contract|selenium|"
    r"functions?|scripts?|code|coding|program|programming|compile\w*|segmentation fault|syntax error|traceback|"
    r"stack trace|exception|unit tests?|refactor\w*|debug\w*|source code|snippet|dataframe|linux|terminal|"
    r"command line|npm|pip install|endpoint|interface|struct|pointer|recursion|recursive|binary search|"
    r"linked list|hash ?map|list comprehensions?|regular expressions?|terraform|ansible|aws|s3|gcp|azure|config file|chrome extension|browser extension|plugin|wordpress|dict|webpack|babel|eslint|npm|yarn|module not found|import error|shell command|cli|command|stack overflow|nginx|apache|cron|ssh|http request|rest api|graphql|oauth|jwt|css|jquery|ajax|unity|unreal engine|arduino|raspberry pi|latex|markdown|time complexity|big o|quicksort|sorting algorithm|dictionary in|data structure|algorithm|div|frontend|backend|repository|repo)\b",
    re.IGNORECASE)
_CODE_WEAK = re.compile(r"\b(class|method|variable|array|loop|database|library|framework|app|website|webpage|"
                        r"bug|implement|implementation|query|server|string|integer|boolean|parse|parses|deploy\w*|"
                        r"tree|graph|sort|model|neural network|file|files)\b", re.IGNORECASE)
_EQUATION = re.compile(r"(\d\s*[-+*/^×÷]\s*\(?-?\d|[a-z)]\s*\^\s*\(?\d|\d\s*[a-z]\s*[-+=]|=\s*-?\d|\b[xyz]\s*=|"
                       r"\d\s*%|\b(sin|cos|tan|log|ln|exp)\s*\(|\\frac|\\sqrt|\\int|\\sum|\$[^$\n]+\$|√|∫|∑|π|"
                       r"≤|≥|\d+x\d+|\d\s*:\s*\d)", re.IGNORECASE)
_QUANTITY_Q = re.compile(r"\b(how (many|much|long|far|old)|what (is|was|will) the (total|sum|product|"
                         r"difference|average|area|perimeter|volume|probability|value|ratio|percentage))\b",
                         re.IGNORECASE)
_MATH_STRONG = re.compile(
    r"\b(solve|equations?|calculate|compute|integral|derivative|differentiate|integrate|limit of|probability|"
    r"percent|percentage|fractions?|ratio|average|median|variance|standard deviation|area|perimeter|volume|radius|"
    r"diameter|triangle|rectangle|polynomial|quadratic|linear algebra|matrix|matrices|determinant|"
    r"eigenvalues?|prove|proof|theorem|lemma|prime number|prime|factori[sz]e|divisible|remainder|arithmetic|"
    r"geometry|algebra|calculus|trigonometry|logarithm|irrational|simplify|evaluate|lowest terms|"
    r"compound interest|quadratic formula|sum of the first|ways can|how many ways|times|minus|plus|divided by|multiplied by|square root|cube root|squared|cubed|least common multiple|lcm|gcd|greatest common divisor|common denominator|chance of|odds of|even numbers?|odd numbers?|hypotenuse|pythagor\w*|integers?|digits|decimal|exponential|inequality|mod|modulo|sequence|series|converge\w*|statistics|expected value|standard deviation|permutations?|combinations?|factorial|slope|scientific notation|fahrenheit|celsius|unit conversion|angles?|workers)\b", re.IGNORECASE)
_MATH_WEAK = re.compile(r"\b(numbers|mean|sum|product|total|cost|costs|price|per hour|per year|each year|"
                        r"dollars|cents|km|kilomet\w+|metres|meters|miles|degrees|twice|half|times as|"
                        r"step by step)\b|\banswer:|\$\d", re.IGNORECASE)
_DIGIT = re.compile(r"\d")


@dataclass(frozen=True)
class DomainScores:
    code: float
    math: float
    syntax: float       # the part of ``code`` that comes from source-like text (fences, statements, operators)


def domain_scores(text: str) -> DomainScores:
    """The evidence for code and for math in ``text`` (see the module docstring); each term is capped so
    one repeated cue cannot outweigh all the others."""
    syntax = (4.0 * min(len(_FENCE.findall(text)), 1) + 1.5 * min(len(_SOURCE_LINE.findall(text)), 4)
              + 0.75 * min(len(_CODE_PUNCT.findall(text)), 6))
    code = syntax + 2.0 * min(len(_CODE_STRONG.findall(text)), 3) + 0.5 * min(len(_CODE_WEAK.findall(text)), 4)
    digits = len(_DIGIT.findall(text))
    math = (1.5 * min(len(_EQUATION.findall(text)), 4) + 2.0 * min(len(_MATH_STRONG.findall(text)), 3)
            + 1.0 * min(len(_QUANTITY_Q.findall(text)), 2) + 0.5 * min(len(_MATH_WEAK.findall(text)), 4)
            + (0.5 if digits >= 2 else 0.0) + (0.5 if digits >= 6 else 0.0))
    return DomainScores(code=code, math=math, syntax=syntax)


def classify_prompt(text: str) -> str:
    """``"code"``, ``"math"`` or ``"chat"`` for a prompt: the domain whose score clears its threshold and
    is the larger, where source-like text decides for code (a program that computes something is a code
    request, and code is full of numbers and operators); ``chat`` otherwise."""
    s = domain_scores(text)
    if s.code >= CODE_THRESHOLD and (s.code >= s.math or s.syntax >= CODE_THRESHOLD):
        return "code"
    if s.math >= MATH_THRESHOLD:
        return "math"
    return "code" if s.code >= CODE_THRESHOLD else "chat"

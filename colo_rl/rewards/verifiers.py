"""Built-in verifiable rewards: a registry of reward functions and answer extraction.

The final answer is the number literal the response states as its answer ("The answer is 58.",
"Answer: 58", "\\boxed{58}"). Only a literal is accepted: math-verify evaluates expressions, so
comparing the raw text would pay a policy for restating the question ("23 + 35" verifies as 58).
"""

from __future__ import annotations

import logging
import re
import threading
from decimal import Decimal
from typing import Callable, Optional

# Thousands separators: a comma, LaTeX's thin space "\," and math comma "{,}", a typographer's thin
# space. Not a plain or no-break space: "3 250 ml bottles" is 3 bottles, not 3250.
_GROUP = r"(?:,|\\,|\{,\}|[\u2009\u202f])"
# A whole literal, never a part of one: digits grouped by thousands ("1,234", "1\\,000") or not, a
# decimal part; not inside a longer literal ("12,34,5", "7e2", "1.2.3"); no backtracking to a prefix.
NUMBER = (r"(?<![\d,.])-?(?:\d{1,3}(?:" + _GROUP + r"\d{3})+|\d+)(?:\.\d+)?"
          r"(?![\d])(?![.,]\d)(?![eE][-+]?\d)")
# Markup before the literal: spaces, * and ** (italic, bold), ` (code), $ (and $$), \(, \$, and
# \textbf{ \mathbf{ \text{ \mathrm{. Possessive (*+): one way to read a run of them, so a run with no
# number after it fails at once (a plain * tried every split of "$$$...": exponential in its length).
# "(" only around a whole literal with nothing after it on its line but punctuation: "(18)." is an
# answer; "(18) + 2" is an expression, "(1) Janet has..." a list item and "(3) 42" a label.
_MARKUP = (r"(?:\s|\*|`|\$|\\\(|\\\$|\\(?:textbf|mathbf|text|mathrm)\{"
           r"|\((?=[ \t]*-?\d[\d,.]*[ \t]*\)(?![ \t]*[-+*/^×÷(\w])))*+")
# a following operator on the same line: an expression, which does not count (a markdown list's
# "- 3 boxes" on the next line is not one)
_NOT_AN_EXPRESSION = r"(?![ \t]*[-+*/^×x÷][ \t]*\d)"
_NOT_A_HEADING = r"(?![.)][ \t]*[A-Za-z])"  # "#### 2. Verification": a heading, not an answer
# "Answer:" over a numbered list ("Answer:\n1. Janet has 16 eggs", "(1) Janet ..."): its first number is no answer
_NOT_A_LIST = r"(?!(?:[ \t]|\*\*)*+\n\s*+\(?\d+[.)][ \t]*[A-Za-z])"
# A stated answer: "answer is 58", "answer is: 58", "**Answer**: 58", "answer = $58$", "#### 58" at a
# line's start (GSM8K's; "#### 2. Verification", a markdown heading, is not one), "\boxed{58}" (a
# unit, %, or a final period inside the box allowed).
_STATED = re.compile(
    r"(?:answer\**+\s*+(?:is(?:\s*+:)?|:|=)" + _NOT_A_LIST + _MARKUP + "(" + NUMBER + ")" + _NOT_AN_EXPRESSION
    + ")"
    r"|(?:^[ \t]*+####" + _MARKUP + "(" + NUMBER + ")" + _NOT_AN_EXPRESSION + _NOT_A_HEADING + ")"
    r"|(?:\\boxed\{" + _MARKUP + "(" + NUMBER + r")\}?\s*+(?:\\%|%|\\text\{[^{}]*\}|\.)?\s*+\})",
    re.IGNORECASE | re.MULTILINE,
)
_ANY_NUMBER = re.compile(NUMBER)
_MINUS = str.maketrans({"\u2212": "-"})  # the Unicode minus sign
# "-\$18" / "-$18": a sign before the currency mark, moved after it ("\$-18") so the literal keeps it;
# not a minus after an amount ("$10-$3", "$10 - $3": an operation)
_SIGN_BEFORE_CURRENCY = re.compile(r"-(\s*+)(\\?\$)")
_OPERAND_END = re.compile(r"[\d$%)\]}][ \t]*\Z")
_SEPARATORS = re.compile(_GROUP)
# "$1 000$": TeX ignores spaces in math mode, so this is 1000 (a plain space elsewhere separates numbers)
_SPACED_MATH_LITERAL = re.compile(r"(?<=\$)-?\d{1,3}(?: \d{3})+(?:\.\d+)?(?=\$)")


def _normalized(text: str) -> str:
    text = _SPACED_MATH_LITERAL.sub(lambda m: m.group(0).replace(" ", ""), text.translate(_MINUS))

    def sign(m: re.Match) -> str:
        if _OPERAND_END.search(text, max(0, m.start() - 64), m.start()):  # an operator, not a sign
            return m.group(0)
        return m.group(2) + m.group(1) + "-"

    return _SIGN_BEFORE_CURRENCY.sub(sign, text)


def _plain(literal: str) -> str:
    """A literal without its thousands separators ("1,234" and "1\\,234" -> "1234")."""
    return _SEPARATORS.sub("", literal)


def extract_final_answer(text: str) -> Optional[str]:
    """The last stated answer literal (thousands separators removed), or None when none is stated."""
    matches = list(_STATED.finditer(_normalized(text)))
    if not matches:
        return None
    m = matches[-1]
    return _plain(next(g for g in m.groups() if g is not None))


_LITERAL = re.compile(r"\s*" + _MARKUP + NUMBER + r"\s*")


def is_number_literal(truth: str) -> bool:
    """Can a stated answer ever match this truth? The verifiers compare number literals only
    (`\\frac{1}{2}`, `(1,2)` or `x = 3` never match)."""
    return _LITERAL.fullmatch(_normalized(str(truth))) is not None


def extract_last_number(text: str) -> Optional[str]:
    """Lenient extraction (last number anywhere); reported as a metric, never rewarded."""
    nums = _ANY_NUMBER.findall(_normalized(text))
    return _plain(nums[-1]) if nums else None


_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # ASCII digits: math-verify reads no others


def plain_numbers_match(predicted: str, truth: str) -> Optional[bool]:
    """math-verify's verdict on two plain decimal literals where it is sure without asking it (it
    takes ~4 ms a pair, most of a step's reward time): equal values match; two integers that differ
    do not. None otherwise: decimals that differ may still match under math-verify's rounding
    (62.3257 and 62.325700001), and other truths ("1,000", "\\frac12") need its parser."""
    p, t = predicted.strip(), str(truth).strip()
    if not (_DECIMAL.fullmatch(p) and _DECIMAL.fullmatch(t)):
        return None
    if Decimal(p) == Decimal(t):
        return True
    return False if "." not in p and "." not in t else None


_QUIET_NO_TIMEOUT: list[bool] = []


def answers_match(predicted: Optional[str], truth: str) -> bool:
    """math-verify equivalence of two number literals (1000 == 1,000 == 1000.0)."""
    if predicted is None:
        return False
    exact = plain_numbers_match(predicted, truth)
    if exact is not None:
        return exact
    from math_verify import parse, verify

    # math-verify's time limits are SIGALRM, which only the main thread can set: elsewhere (an
    # environment's step runs in a worker thread) they raise, and every answer would read as wrong.
    # Two number literals never need the limit (and the caller's thread has its own).
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    if limit is None and not _QUIET_NO_TIMEOUT:
        for name in ("math_verify.parser", "math_verify.grader"):  # "you must provide the timeout logic yourself"
            logging.getLogger(name).addFilter(lambda r: not r.getMessage().startswith("Timeout is disabled"))
        _QUIET_NO_TIMEOUT.append(True)
    try:
        gold = parse(f"${truth}$", parsing_timeout=limit)
        pred = parse(f"${predicted}$", parsing_timeout=limit)
        return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - an unparsable answer is simply wrong
        return False


RewardFn = Callable[[str, str], float]  # (completion text, ground truth) -> reward
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        return fn

    return wrap


@register_reward("math_verify")
def math_verify_reward(completion: str, truth: str) -> float:
    """1.0 when the stated final answer equals the ground truth, else 0.0."""
    return 1.0 if answers_match(extract_final_answer(completion), truth) else 0.0


@register_reward("last_number")
def last_number_reward(completion: str, truth: str) -> float:
    """1.0 when the last number in the response equals the ground truth, stated or not.

    Partial credit for a worked answer that computed the right result ("18 - 17 = 1.") but did not
    state it: with `math_verify` beside it, a correct stated answer earns 2, a correct unstated one
    1, so the policy is pulled towards working the problem out and then stating the result, not
    towards guessing in the required format. Echoing the question ends on an operand: it scores 0.
    """
    return 1.0 if answers_match(extract_last_number(completion), truth) else 0.0


@register_reward("format")
def format_reward(completion: str, truth: str) -> float:
    """1.0 when a final answer is stated as a number literal, whatever its value."""
    return 1.0 if extract_final_answer(completion) is not None else 0.0

"""The verifier: answer extraction, the echo trap, fault isolation."""

import math

import pytest

from colo_rl.config import ConfigError, RewardConfig
from colo_rl.rewards import (REWARD_FUNCTIONS, RewardError, RewardScorer, extract_final_answer,
                             extract_last_number, register_reward)


@pytest.mark.parametrize("text,expected", [
    ("23 + 35 = 58. The answer is 58.", "58"),
    ("Answer: 1,234", "1234"),
    ("so \\boxed{-7}", "-7"),
    ("The answer is 3. No wait, the answer is 4.", "4"),
    ("I think it is 58.", None),
    ("The answer is 23 + 35.", None),  # an expression is not an answer
    ("#### 23 + 35", None),
    ("The answer is: 42", "42"),
    ("Janet makes 18 dollars.\n#### 1,018", "1018"),  # GSM8K's own format
    ("**Answer**: $42$", "42"),
    ("The answer is **\\$42**.", "42"),
    ("The answer is \\( 42 \\)", "42"),
    ("\\boxed{72 \\text{ clips}}", "72"),
    ("\\boxed{42\\%}", "42"),
    ("\\boxed{72.}", "72"),
    ("The answer is \u22127", "-7"),  # a Unicode minus
    ("The answer is 7,2", None),  # not thousands: no literal
    ("The answer is 7e2", None),  # not 7
    ("The answer is 3.5.", "3.5"),
    ("**Answer:** 72\n\n#### 2. Verification\nIt checks out.", "72"),  # a markdown heading is no answer
    ("text #### 5", None),  # GSM8K's mark opens a line
    ("**Answer:** 18\n\n- 3 boxes of 6 eggs each", "18"),  # a list on the next line is no expression
    ("She earns 9 * 2 = 18 dollars.\n#### 18.\nI hope this helps!", "18"),  # nor is a sentence a heading
    ("The answer is 18 - 2", None),
    ("Answer:\n1. Janet has 16 eggs and eats 3.\n2. She sells the rest.", None),  # a numbered list
    ("**Answer:**\n1. Janet sells 13 at $2 = $26.", None),
    ("**Answer:**\n\n26", "26"),
    ("The answer is 18. She sells the rest.", "18"),
    ("The answer is *18*.", "18"),  # italics, code, bold inside a box
    ("*Answer*: `18`", "18"),
    ("\\boxed{\\textbf{18}}", "18"),
    ("The answer is $1\\,000$.", "1000"),  # thousands in LaTeX's and typesetters' spacing, not 1
    ("The answer is 1\u2009000.", "1000"),
    ("The answer is 3 250 ml bottles.", "3"),  # a plain space separates two numbers
    ("\\boxed{1{,}000}", "1000"),
    ("The answer is -\\$18.", "-18"),  # a sign before the currency mark is kept
    ("The answer is $10-$3", "10"),  # a difference of amounts is no sign
    ("The answer is (18).", "18"),  # parentheses around the literal alone
    ("The answer is (18) + 2", None),
    ("The answer is (18 + 2)", None),
    ("Answer:\n(1) Janet has 16 eggs\n(2) She eats 3", None),  # a list's label is no answer
    ("The answer is (3) 42", None),
    ("The answer is $1 000$.", "1000"),  # TeX ignores a space in math mode
    ("The answer is $1 000 apples", "1"),  # outside math a space still separates
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_echoing_the_question_scores_zero():
    """math-verify would evaluate '23 + 35' to 58; the reward must not pay for restating it."""
    scorer = RewardScorer(RewardConfig(format_weight=0.0))
    for echo in ["23 + 35", "The answer is 23 + 35", "answer: 23 + 35", "\\boxed{23 + 35}"]:
        res = scorer.score([echo], ["58"])
        assert res.rewards == [0.0], echo
        assert res.correct == [False]


def test_correct_answer_scores_one_with_format_bonus():
    scorer = RewardScorer(RewardConfig(format_weight=0.1))
    res = scorer.score(["23 + 35 = 58. The answer is 58.", "The answer is 57.", "58"], ["58", "58", "58"])
    assert res.rewards == pytest.approx([1.1, 0.1, 0.0])
    assert res.correct == [True, False, False]
    assert res.correct_lenient == [True, False, True]
    assert extract_last_number("a 1 b 2,000") == "2000"
    assert extract_last_number("She lost -$18") == "-18"
    assert extract_last_number("Total: $10 - $3") == "3"  # a difference: no sign
    assert extract_last_number("Scores: 7 100 and 9 250") == "250"


def test_number_search_is_linear_in_the_text():
    """The lenient search runs on every completion in the trainer's thread: a run of '1,' pairs once
    took 2.3 s for 16k characters (backtracking into a literal's comma groups)."""
    import time
    t0 = time.perf_counter()
    assert extract_last_number("1," * 50_000 + "1.1.1") is None
    assert extract_final_answer("The answer is " + "1," * 50_000) is None
    # runs of markup with no number after them: "$" x 32 took 2 s, each further "$" doubling it
    for opener in ("The answer is ", "#### ", "\\boxed{"):
        assert extract_final_answer(opener + "$" * 5_000 + "x") is None
        assert extract_final_answer(opener + "$$ " * 5_000 + "x") is None
    assert extract_final_answer("The answer is" + " " * 50_000) is None
    assert time.perf_counter() - t0 < 1.0


def test_numeric_equivalence_via_math_verify():
    scorer = RewardScorer(RewardConfig(format_weight=0.0))
    assert scorer.score(["The answer is 1,000.", "The answer is 1000.0"], ["1000", "1000"]).rewards == [1.0, 1.0]


def test_answers_match_off_the_main_thread():
    """Environments check answers in worker threads, where math-verify's SIGALRM time limit raises:
    without care every answer there reads as wrong."""
    from concurrent.futures import ThreadPoolExecutor

    from colo_rl.rewards.verifiers import answers_match

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(answers_match, "1,000", "1000.0").result() is True
        assert pool.submit(answers_match, "999", "1000").result() is False


def test_unknown_reward_function_names_the_choices():
    with pytest.raises(ConfigError, match=r"unknown reward function 'math_verfy'.*math_verify"):
        RewardScorer(RewardConfig(functions=["math_verfy"]))


def test_failing_reward_is_isolated_and_counted():
    calls = {"n": 0}

    @register_reward("flaky_for_test")
    def flaky(text, truth):
        calls["n"] += 1
        if "boom" in text:
            raise RuntimeError("verifier crashed")
        if "nan" in text:
            return math.nan
        return 1.0

    try:
        scorer = RewardScorer(RewardConfig(functions=["flaky_for_test"], format_weight=0.0, max_failure_rate=0.5))
        res = scorer.score(["ok", "boom", "nan", "ok"], ["1"] * 4)
        assert res.rewards == [1.0, 0.0, 0.0, 1.0]
        assert res.failures == 2
        assert "RuntimeError: verifier crashed" in res.failure_messages[0]
        strict = RewardScorer(RewardConfig(functions=["flaky_for_test"], format_weight=0.0, max_failure_rate=0.25))
        with pytest.raises(RewardError, match="reward.max_failure_rate"):
            strict.score(["boom", "nan", "ok", "ok"], ["1"] * 4)
    finally:
        REWARD_FUNCTIONS.pop("flaky_for_test")


def test_partial_credit_ladder_prefers_worked_and_stated_answers():
    scorer = RewardScorer(RewardConfig(functions=["math_verify", "last_number"], format_weight=0.1))
    texts = ["23 + 35 = 58. The answer is 58.", "23 + 35 = 58.", "The answer is 57.", "23 + 35", "The answer is 23 + 35"]
    res = scorer.score(texts, ["58"] * len(texts))
    assert res.rewards == pytest.approx([2.1, 1.0, 0.1, 0.0, 0.0])


def test_truths_no_stated_answer_can_match_are_counted_and_named(caplog):
    """MATH-style truths (verl's `ground_truth`, `solution`) that are not number literals score 0 under
    the built-in verifiers whatever the policy writes: the recipes count them at start-up and say so."""
    import logging

    from colo_rl.rewards.verifiers import is_number_literal

    assert all(is_number_literal(t) for t in ["18", " -7 ", "1,000", "3.50", "$42", "\u22125"])
    assert not any(is_number_literal(t) for t in ["\\frac{1}{2}", "1/2", "(1,2)", "x = 3", "2\\sqrt{2}", ""])
    scorer = RewardScorer(RewardConfig(functions=["math_verify"]))
    with caplog.at_level(logging.WARNING, logger="colo_rl"):
        assert scorer.count_unmatchable(["18", "\\frac{1}{2}", "(1,2)"], ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"],
                                        "d.jsonl") == 2
        assert scorer.count_unmatchable(["18", "1,000"], ["d.jsonl:1", "d.jsonl:2"], "d.jsonl") == 0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "d.jsonl: 2 of 3 answers are not number literals (first: '\\\\frac{1}{2}', d.jsonl:2)" in line
    assert "['math_verify'] score them 0" in line and "reward.functions=[path/to/file.py:fn]" in line


def test_the_plain_number_shortcut_gives_math_verifys_own_verdict():
    """answers_match skips math-verify (~4 ms a pair) for plain decimal literals only where its
    verdict is certain: equal values, or two different integers. Checked against math-verify itself
    on integers near each other, zero-padded, huge, and decimals that its rounding may equate."""
    import random

    from math_verify import parse, verify

    from colo_rl.rewards.verifiers import plain_numbers_match

    rng = random.Random(0)
    pairs = [("007", "7"), ("-0", "0"), ("1000", "1000.000"), ("2.50", "2.5"), ("5", "5.0000001"),
             ("62.3257", "62.325700001"), ("123456789012345678", "123456789012345679")]
    for _ in range(150):
        a = rng.choice([rng.randint(-10 ** 6, 10 ** 6), rng.randint(0, 100), rng.randint(10 ** 9, 10 ** 20)])
        pairs += [(str(a), str(a + rng.choice([-1, 1, 10]))), (str(a), str(a)), (str(a), str(-a)), (f"{a}.0", str(a))]
        x = round(rng.uniform(-100, 100), rng.randint(1, 9))
        pairs.append((repr(x), repr(round(x + rng.choice([1e-9, 1e-7, 1e-5, 1e-3]), 10))))
    decided = 0
    for p, t in pairs:
        shortcut = plain_numbers_match(p, t)
        if shortcut is not None:
            decided += 1
            assert shortcut == bool(verify(parse(f"${t}$"), parse(f"${p}$"))), (p, t)
    assert decided >= len(pairs) * 0.75  # the shortcut takes the common case (integers)
    assert plain_numbers_match("62.3257", "62.325700001") is None and plain_numbers_match("1,000", "1000") is None
    assert plain_numbers_match("\uff13", "3") is None  # a fullwidth 3: math-verify's to judge (it says no)

"""MATH-style answer extraction, normalisation and equivalence (paper reward, docs/algorithm.md §9)."""

from __future__ import annotations

import pytest

from hacrl_megatron.reward import (
    RewardRequest,
    check_integer,
    check_math,
    is_equiv,
    last_boxed_answer,
    normalize_answer,
    score_request,
)

# (model answer, reference, expected equal) — normalisations and the traps a careless one falls into.
EQUIV_TABLE = [
    # fractions and decimals
    ("\\frac12", "0.5", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "\\frac34", True),
    ("1/2", "\\frac{1}{2}", True),
    ("0.5", "1/2", True),
    (".5", "0.5", True),
    ("0.50", "\\frac{1}{2}", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-\\frac{1}{2}", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("12", "1/2", False),
    ("12", "\\frac12", False),
    ("\\frac{1}{3}", "0.333", False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False),
    # integers, leading zeros, signs, 2.0 vs 2
    ("2.0", "2", True),
    ("2.", "2", True),
    ("007", "7", True),
    ("+5", "5", True),
    ("-5", "5", False),
    ("2.01", "2", False),
    ("10", "100", False),
    # thousands separators
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("1\\,000", "1000", True),
    ("12,345,678", "12345678", True),
    ("1,2", "12", False),
    ("1,000", "100", False),
    # equations
    ("x=2", "2", True),
    ("x = 3", "3", True),
    ("k=-4", "-4", True),
    ("y=2x+1", "2x+1", True),
    ("x=2", "3", False),
    # \text, choices
    ("\\text{(A)}", "A", True),
    ("(B)", "B", True),
    ("\\textbf{(C)}", "C", True),
    ("\\text{(A)}", "B", False),
    ("\\text{even}", "even", True),
    ("\\mathrm{odd}", "\\text{odd}", True),
    # units, degrees, dollars, percent
    ("5\\text{ cm}", "5", True),
    ("5 cm", "5", True),
    ("12 inches", "12", True),
    ("10 dollars", "10", True),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    ("30°", "30", True),
    ("\\$5", "5", True),
    ("\\$5.00", "5", True),
    ("50\\%", "50", True),
    ("50%", "50", True),
    ("5\\text{ cm}", "6", False),
    ("1\\text{ and }2", "1", False),
    # spaces, \left \right, \!, trailing period
    ("\\left(1,2\\right)", "(1,2)", True),
    ("( 1 , 2 )", "(1,2)", True),
    ("(1,2)", "(2,1)", False),
    ("1\\!000", "1000", True),
    ("3.", "3", True),
    ("x^2 + 2x + 1", "x^2+2x+1", True),
    ("[2,5)", "[2,5]", False),
    # roots
    ("sqrt2", "\\sqrt{2}", True),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("\\sqrt(3)", "\\sqrt{3}", True),
    ("2\\sqrt2", "2\\sqrt{2}", True),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("\\sqrt[3]{2}", "\\sqrt{2}", False),
    # expressions / symbols
    ("\\frac\\pi2", "\\frac{\\pi}{2}", True),
    ("\\pi", "3.14", False),
    ("\\infty", "\\infty", True),
    ("", "0", False),
]


@pytest.mark.parametrize("answer,reference,expected", EQUIV_TABLE)
def test_is_equiv_table(answer, reference, expected):
    assert is_equiv(answer, reference) is expected
    # symmetric: the verifier must not depend on which side is the reference
    assert is_equiv(reference, answer) is expected


def test_table_size():
    assert len(EQUIV_TABLE) >= 60


@pytest.mark.parametrize(
    "text,expected",
    [
        ("the answer is \\boxed{5}.", "5"),
        ("\\boxed{1} first, then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and finally \\fbox{4}", "4"),
        ("so $\\boxed 5$", "5"),
        ("\\boxed {12}", "12"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("no box here: 42", None),
        ("truncated \\boxed{1", None),
        ("\\boxed", None),
        ("\\boxedx{3}", None),
    ],
)
def test_last_boxed_answer(text, expected):
    assert last_boxed_answer(text) == expected


def test_extraction_of_deeply_nested_braces_is_linear():
    deep = "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}"
    assert last_boxed_answer(deep) == "{" * 50_000 + "1" + "}" * 50_000
    assert last_boxed_answer("\\boxed{" + "{" * 50_000) is None


def test_normalize_answer_examples():
    assert normalize_answer("\\frac12") == "\\frac{1}{2}"
    assert normalize_answer("\\left( \\dfrac{3}{4}, 2 \\right)") == "(\\frac{3}{4},2)"
    assert normalize_answer("x = 3") == "3"
    assert normalize_answer("1/2") == "\\frac{1}{2}"
    assert normalize_answer("\\text{(A)}") == "A"


def test_normalize_rejects_pathological_length():
    with pytest.raises(ValueError, match="MAX_ANSWER_CHARS"):
        normalize_answer("1" * 5000)
    assert is_equiv("1" * 5000, "1" * 5000) is False


def test_check_math_uses_last_box_only():
    assert check_math("I think \\boxed{3}, no wait, \\boxed{4}", "4") == 1.0
    assert check_math("I think \\boxed{4}, no wait, \\boxed{3}", "4") == 0.0
    assert check_math("the answer is 4", "4") == 0.0  # paper parity: no box, no reward


@pytest.mark.parametrize(
    "response,reference,expected",
    [
        (" 85", "85", 1.0),
        ("\\boxed{85}", "85", 1.0),
        ("x=\\boxed{-7}", "-7", 1.0),
        ("\\boxed{85.0}", "85", 1.0),
        ("\\boxed{1,318}", "1318", 1.0),
        ("85 apples", "85", 0.0),
        ("\\boxed{86}", "85", 0.0),
        ("", "85", 0.0),
        ("8 5", "85", 0.0),
    ],
)
def test_check_integer(response, reference, expected):
    assert check_integer(response, reference) == expected


def test_score_request_dispatch_and_validation():
    assert score_request(RewardRequest("math", "\\boxed{\\frac12}", "0.5")) == 1.0
    assert score_request(RewardRequest("integer", "\\boxed{12}", "12")) == 1.0
    assert score_request(RewardRequest("countdown", "\\boxed{2*3*4}", "24|2,3,4,5")) == 1.0
    with pytest.raises(ValueError, match="kind='code'"):
        RewardRequest("code", "x", "y")
    with pytest.raises(TypeError, match="response must be str"):
        RewardRequest("math", None, "y")
    with pytest.raises(ValueError, match="reward mode 'sympy'"):
        score_request(RewardRequest("math", "\\boxed{1}", "1"), mode="sympy")


def test_verifier_never_raises_on_arbitrary_text():
    """Property check: extraction, normalisation and scoring accept any text and stay in [0, 1]."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    alphabet = st.sampled_from(
        list("0123456789+-*/^{}()[]\\.,=xyz $%!") + ["\\boxed{", "\\frac", "\\sqrt", "\\text{"]
    )
    texts = st.lists(alphabet, max_size=60).map("".join)

    @settings(max_examples=300, deadline=None, database=None)
    @given(texts, texts)
    def check(response, reference):
        for kind in ("math", "integer"):
            value = score_request(RewardRequest(kind, response, reference or "0"))
            assert value in (0.0, 1.0)
        assert is_equiv(response, reference) == is_equiv(reference, response)
        if response.strip():
            assert is_equiv(response, response) or len(response) > 2000

    check()

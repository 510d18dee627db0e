"""Countdown checker: safe ast parsing, allowed operators, sub-multiset of numbers, exact division."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hacrl_megatron.reward import check_countdown, encode_countdown_reference, parse_countdown_reference
from hacrl_megatron.reward.countdown import countdown_expression_value

REF = "24|2,3,5,7"


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("(7-3)*(5+1)", 0.0),  # 1 is not a given number
        ("(7+5)*2", 1.0),
        ("(7-5)*3*(2+2)", 0.0),  # 2 used twice, given once
        ("2*3*(7-5)*2", 0.0),  # 2 used three times
        ("(5+7)*2", 1.0),
        ("3*(5+7)/2*(7-5)/2", 0.0),  # 2 used three times
        ("(7\\times 3+5-2)", 1.0),  # 21 + 5 - 2 = 24; outer parentheses are fine
        ("7 \\times 3 + 5 - 2", 1.0),
        ("(2+5) \\cdot 3 + 3", 0.0),  # 3 used twice
        ("\\frac{7 \\cdot 3 \\cdot 2 + 6}{2}", 0.0),  # 6 not given
        ("\\frac{5 \\cdot 7 + 3 \\cdot 2 + 7}{2}", 0.0),  # 7 twice
        ("(5*7-3-2*4)", 0.0),  # 4 not given
        ("2*(5+7)", 1.0),
        ("2 \\times (5 + 7) = 24", 1.0),
        ("24 = 2*(5+7)", 1.0),
        ("2*(5+7) = 25", 0.0),
        ("(7*5-3)*3/4", 0.0),
        ("7*(5-2)+3", 1.0),
        ("(3 ÷ 3)", 0.0),
        ("5*(7-2)-3+2", 0.0),  # 2 twice
        ("24", 0.0),  # the target literal is not a given number
        ("2**5-7-3+2", 0.0),  # power not allowed (and 2 twice)
        ("-2*(-5-7)", 0.0),  # unary minus not allowed
        ("__import__('os')", 0.0),
        ("7*(5-2)+3.0", 0.0),  # float literal not allowed
        ("(7-7)/0+24", 0.0),
        ("2*(5+7", 0.0),  # syntax error
    ],
)
def test_countdown_cases(expr, expected):
    assert check_countdown(f"so \\boxed{{{expr}}}", REF) == expected


def test_division_is_exact_with_fractions():
    # 8 / (3 - 8/3) = 24 needs exact rational arithmetic (floats give 23.999...).
    assert countdown_expression_value("8/(3-8/3)", [8, 3, 8, 3]) == Fraction(24)
    assert check_countdown("\\boxed{8/(3-8/3)}", "24|3,3,8,8") == 1.0
    assert check_countdown("\\boxed{8\\div(3-8\\div3)}", "24|3,3,8,8") == 1.0
    assert check_countdown("\\boxed{7/2}", "3|7,2") == 0.0  # 3.5, not 3


def test_no_box_and_pathological_inputs_score_zero():
    assert check_countdown("(7+5)*2", REF) == 0.0
    assert check_countdown("\\boxed{" + "(" * 5000 + "2" + ")" * 5000 + "}", REF) == 0.0
    assert check_countdown("\\boxed{9**9**9}", REF) == 0.0
    assert check_countdown("\\boxed{" + "9" * 100 + "}", REF) == 0.0
    assert check_countdown("\\boxed{\x00\xff}", REF) == 0.0


def test_reference_round_trip_and_errors():
    assert parse_countdown_reference(encode_countdown_reference(24, [2, 3, 5, 7])) == (24, [2, 3, 5, 7])
    with pytest.raises(ValueError, match="target\\|n1,n2"):
        parse_countdown_reference("24: 2 3 5 7")
    with pytest.raises(ValueError, match="non-empty"):
        encode_countdown_reference(24, [])
    with pytest.raises(ValueError, match="non-negative ints"):
        encode_countdown_reference(24, [2, -3])

"""The math_verify reward mode: symbolic equivalence on top of the paper's string match; screens."""

from __future__ import annotations

import threading

import pytest

from hacrl_megatron.reward import RewardRequest, score_request
from hacrl_megatron.reward.math_verify_backend import looks_explosive, math_verify_equal

pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    "response,reference,string_mode,symbolic_mode",
    [
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 0.0, 1.0),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 0.0, 1.0),
        ("\\boxed{\\frac{\\sqrt{8}}{2}}", "\\sqrt{2}", 0.0, 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0, 1.0),
        ("\\boxed{x=2}", "2", 1.0, 1.0),  # string match accepted first: never stricter than "math"
        ("\\boxed{3}", "2", 0.0, 0.0),
        ("\\boxed{x^2-1}", "(x-1)^2", 0.0, 0.0),
        ("the answer is 7", "7", 0.0, 1.0),  # math-verify also reads unboxed answers
    ],
)
def test_math_verify_mode_vs_string_mode(response, reference, string_mode, symbolic_mode):
    req = RewardRequest("math", response, reference)
    assert score_request(req, mode="math") == string_mode
    assert score_request(req, mode="math_verify") == symbolic_mode


def test_math_verify_works_off_the_main_thread():
    """math-verify's signal.alarm limits only work in the main thread; off it they are disabled
    (the pool's process timeout is the bound), so scoring in a thread must not raise."""
    out = {}

    def run():
        out["v"] = math_verify_equal("\\boxed{\\frac{1}{2}}", "0.5")

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out == {"v": True}


@pytest.mark.parametrize(
    "text,reason",
    [
        ("10^{1000000}", "huge exponent"),
        ("2**123456", "huge exponent"),
        ("9^{9^{9}}", "power tower"),
        ("9^9^9", "power tower"),
        ("9**9**9", "power tower"),
        ("100000!", "huge factorial"),
        ("1" * 1500, "huge numeral"),
        ("(" * 100 + "1" + ")" * 100, "nesting deeper than 64"),
    ],
)
def test_explosive_screen_flags(text, reason):
    assert looks_explosive(text) == reason


@pytest.mark.parametrize("text", ["2^{2023}", "x^2+2x+1", "\\frac{1}{2}", "3!", "e^{i\\pi}", "((1+2)*3)"])
def test_explosive_screen_passes_normal_answers(text):
    assert looks_explosive(text) is None

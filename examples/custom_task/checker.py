"""The task's verifier: a plain function (response, reference) -> reward in [0, 1].

``reference`` is the row's ``answer`` ("400+57"); any two non-negative integers in the response's
last ``\\boxed{}`` that add up to the same N score 1, everything else 0. hacrl_megatron imports this
file by path (``data.checker: examples/custom_task/checker.py:score``) in the trainer and in each
verifier process; an exception or a value outside [0, 1] scores 0 and is counted, never a crash.
"""

import re

from hacrl_megatron.reward import last_boxed_answer

_PAIR = re.compile(r"^\s*(\d{1,6})\s*\+\s*(\d{1,6})\s*$")


def score(response: str, reference: str) -> float:
    target = sum(int(part) for part in reference.split("+"))
    match = _PAIR.match(last_boxed_answer(response) or "")
    return 1.0 if match and int(match[1]) + int(match[2]) == target else 0.0

"""Time of the math-verify pre-screen (``looks_explosive``) on hostile answers: the linear scan vs the
regular expressions it replaced.

    python benchmarks/bench_explosive_screen.py                  # new screen up to 20k characters
    python benchmarks/bench_explosive_screen.py --old-max 5000   # also the old regexes, up to 5k

The screen runs on untrusted model output before any time limit applies (with ``num_workers=0``
there is none at all), so its cost must grow linearly with the answer. Each row is the best of
``--repeats`` single-threaded calls (``time.perf_counter``). The old regexes backtrack
quadratically (digit runs, blank runs after ``^``) or worse (blanks, a word and blanks after ``**``):
they are only timed up to ``--old-max`` characters, where they already take seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hacrl_megatron.reward.math_verify_backend import looks_explosive  # noqa: E402

OLD = [  # the screen before the linear scan, for comparison only
    re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{5,}"),
    re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?\s*\d+\s*\)?\s*\^|\*\*\s*\(?\s*[\w.]+\s*\)?\s*\*\*"),
    re.compile(r"\d{4,}\s*!"),
    re.compile(r"\d{1000,}"),
]

CASES = {
    "digits": lambda n: "1" * n,
    "digits then !": lambda n: "7" * (n - 3) + "  !",
    "^ then blanks": lambda n: "^" + " " * (n - 1),
    "** blanks word blanks": lambda n: "** " + " " * (n // 3) + "a" * (n // 3) + " " * (n - 3 - 2 * (n // 3)),
    "normal answer x20": lambda n: ("\\frac{x^2+2x+1}{(x+1)} " * (n // 24 + 1))[:n],
}


def best_time(fn, text: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return best


def old_screen(text: str) -> bool:
    return any(p.search(text) for p in OLD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2500,5000,10000,20000", help="answer lengths in characters")
    ap.add_argument("--old-max", type=int, default=0, help="also time the old regexes up to this length")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| input | chars | linear scan (ms) | old regexes (ms) |")
    print("|---|---:|---:|---:|")
    for name, make in CASES.items():
        for n in sizes:
            text = make(n)
            new = best_time(looks_explosive, text, args.repeats) * 1e3
            old = f"{best_time(old_screen, text, 1) * 1e3:.1f}" if n <= args.old_max else "—"
            print(f"| {name} | {n} | {new:.2f} | {old} |", flush=True)


if __name__ == "__main__":
    main()

"""Write a user's own verifiable task as JSON lines: data/train.jsonl (800 rows), data/test.jsonl (100).

Each row asks for N (100..999) as a sum of two non-negative integers, ``{"id": "sum-457",
"question": "457=a+b", "answer": "400+57", "solution": "\\\\boxed{400+57}"}``. ``answer`` is one
correct answer (the checker derives N from it); ``solution`` is what the supervised warm-up teaches.
Many other answers are right (``57+400``, ``228+229``): that is why this task needs its own checker
(checker.py). The two files are disjoint; training also holds out 1 in 10 of its rows for the
in-training evaluation.

    python examples/custom_task/make_data.py [OUT_DIR]     # default: examples/custom_task/data
"""

import json
import random
import sys
from pathlib import Path


def row(n: int) -> dict:
    answer = f"{n - n % 100}+{n % 100}"  # the taught split: hundreds + the rest
    return {"id": f"sum-{n}", "question": f"{n}=a+b", "answer": answer, "solution": f"\\boxed{{{answer}}}"}


def main(out: Path) -> None:
    numbers = list(range(100, 1000))
    random.Random(0).shuffle(numbers)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", numbers[:800]), ("test", numbers[800:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row(n)) + "\n" for n in part)
        print(f"wrote {out / name}.jsonl ({len(part)} rows)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("data"))

"""Procedural verifiable tasks: seeded, dependency-free, identical on every machine.

Six generators (the CPU demo runs ``addition``, the heterogeneous-state preset ``addition_cot``, the
complementary-agents preset ``add_sub_cot``):

| task | question (difficulty d) | kind | answer |
|---|---|---|---|
| addition | ``37+48=?`` — two d-digit numbers (d = 1: 0..9) | integer | ``85`` |
| addition_cot | as addition; the SFT target works column by column: ``7+8=15,3+4+1=8 \\boxed{85}`` | integer | ``85`` |
| add_sub_cot | two families: ``add`` as addition_cot, ``sub`` ``52-17=?`` (a ≥ b), its target column by column with borrows: ``12-7=5,5-1-1=3 \\boxed{35}`` | integer | ``35`` |
| arithmetic | ``12*34-56=?`` — three d-digit operands, ops from + − × (usual precedence) | integer | ``352`` |
| linear | ``Solve for x: 3*x+5=20`` — integer solution, coefficients of up to d digits | integer | ``5`` |
| countdown | ``Make 24 from 2, 3, 5, 7 using + - * / (each number at most once).`` — d + 2 numbers in 1..10d | countdown | ``24|2,3,5,7`` |

Determinism: item i of a split is generated from ``random.Random("hacrl/<task>/d<d>/s<seed>/<split>/<i>")``
(string seeds are hashed with SHA-512 by :mod:`random`, never with ``hash()``), so items depend
only on (task, difficulty, seed, split, index): a resumed run continues from its data position.

Train/eval disjointness: every problem has a canonical key (e.g. the unordered pair for addition);
a fixed SHA-256 bucket of the key puts 1 in ``EVAL_BUCKETS`` problems in the eval partition. The
train stream redraws until it hits a train problem and the eval stream until it hits an eval
problem, so no eval problem is ever trained on.

Families: a task may split its problems into named families (``add_sub_cot``: ``add`` and ``sub``). Its
mixed stream draws each item's family at random; ``sample(..., family=f)`` and ``eval_set(n, family=f)``
are the streams of one family (their own seeds, the same split rule), :meth:`ProceduralTask.family_of`
names a record's family, and :meth:`ProceduralTask.sample_mix` draws a weighted mixture (an agent's
warm-up on mostly one family, ``agents.*.warmup_sft_families``).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import random
import re
from dataclasses import dataclass

from hacrl_megatron.data.records import PromptRecord
from hacrl_megatron.reward.countdown import encode_countdown_reference

EVAL_BUCKETS = 10  # 1 in 10 problems is reserved for evaluation
MAX_DIFFICULTY = 12
_MAX_REDRAWS = 2000
_ID_RE = re.compile(r"^(?P<task>[a-z_]+)-d(?P<d>\d+)-s(?P<seed>-?\d+)-(?P<split>train|eval)"
                    r"(?:-(?P<family>[a-z]+))?-(?P<index>\d+)$")


@dataclass(frozen=True)
class _Problem:
    question: str
    answer: str
    key: str  # canonical identity of the problem for the train/eval split
    solution: str  # SFT target: a correct response ending with \boxed{answer}


def _digits_range(d: int) -> tuple[int, int]:
    """Inclusive range of d-digit numbers (d = 1 includes 0)."""
    return (0 if d == 1 else 10 ** (d - 1)), 10**d - 1


def _is_eval_key(key: str) -> bool:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0


class ProceduralTask(abc.ABC):
    """Base class: deterministic train stream, disjoint eval stream, SFT targets.

    Subclasses set ``name`` and ``kind`` and implement ``_generate(rng) -> _Problem``; a task with
    families also sets ``families`` and implements ``_generate_family(rng, family)`` and ``family_of``.
    """

    name = ""
    kind = "integer"
    families: tuple[str, ...] = ()  # named families of problems (empty: one undivided task)

    def __init__(self, difficulty: int, seed: int) -> None:
        if not isinstance(difficulty, int) or not 1 <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(
                f"{self.name}: difficulty={difficulty!r} must be an int in [1, {MAX_DIFFICULTY}]"
            )
        if not isinstance(seed, int):
            raise ValueError(f"{self.name}: seed={seed!r} must be an int")
        self.difficulty = difficulty
        self.seed = seed

    @abc.abstractmethod
    def _generate(self, rng: random.Random) -> _Problem:
        """One problem drawn with ``rng`` (each task defines its own)."""

    def _generate_family(self, rng: random.Random, family: str) -> _Problem:
        """One problem of ``family`` (tasks with families define it)."""
        raise ValueError(f"task {self.name} has no families (asked for {family!r})")

    def family_of(self, record: PromptRecord) -> str | None:
        """The family of one of this task's records (None for a task without families)."""
        return None

    def _check_family(self, family: str | None) -> None:
        if family is not None and family not in self.families:
            raise ValueError(f"{self.name}: family {family!r} is not one of this task's families "
                             f"{list(self.families) or '(none)'}")

    def _problem(self, split: str, index: int, family: str | None = None) -> _Problem:
        stream = split if family is None else f"{split}/{family}"
        rng = random.Random(f"hacrl/{self.name}/d{self.difficulty}/s{self.seed}/{stream}/{index}")
        want_eval = split == "eval"
        for _ in range(_MAX_REDRAWS):
            problem = self._generate(rng) if family is None else self._generate_family(rng, family)
            if _is_eval_key(problem.key) == want_eval:
                return problem
        raise RuntimeError(
            f"{self.name} d={self.difficulty}: no {split} problem found in {_MAX_REDRAWS} draws; "
            "the problem space is too small for a train/eval split — raise the difficulty"
        )

    def _record(self, split: str, index: int, family: str | None = None) -> PromptRecord:
        p = self._problem(split, index, family)
        stream = split if family is None else f"{split}-{family}"
        rid = f"{self.name}-d{self.difficulty}-s{self.seed}-{stream}-{index}"
        return PromptRecord(id=rid, question=p.question, answer=p.answer, source=self.name, kind=self.kind)

    def sample(self, n: int, offset: int = 0, family: str | None = None) -> list[PromptRecord]:
        """Training items ``offset .. offset+n-1`` of the train stream (pure function of the index);
        ``family``: of that family's own stream."""
        if n < 0 or offset < 0:
            raise ValueError(f"{self.name}.sample: n={n} and offset={offset} must be >= 0")
        self._check_family(family)
        return [self._record("train", offset + i, family) for i in range(n)]

    def sample_mix(self, n: int, offset: int, weights: dict[str, float]) -> list[PromptRecord]:
        """Training items ``offset .. offset+n-1`` of a weighted mixture of the families: item i is item i of
        the stream of a family drawn with probability ``weights[f] / sum(weights)`` (seeded by i alone, so a
        resumed warm-up continues it). Families of weight 0 are never drawn."""
        if n < 0 or offset < 0:
            raise ValueError(f"{self.name}.sample_mix: n={n} and offset={offset} must be >= 0")
        for family, weight in weights.items():
            self._check_family(family)
            if not (weight >= 0 and weight != float("inf")):
                raise ValueError(f"{self.name}.sample_mix: weight of {family!r} is {weight!r}; must be finite, >= 0")
        names = [f for f in self.families if weights.get(f, 0) > 0]
        if not names:
            raise ValueError(f"{self.name}.sample_mix: weights {weights} give no family a positive weight")
        out = []
        for i in range(offset, offset + n):
            rng = random.Random(f"hacrl/{self.name}/d{self.difficulty}/s{self.seed}/mix/{i}")
            family = rng.choices(names, weights=[weights[f] for f in names])[0]
            out.append(self._record("train", i, family))
        return out

    def eval_set(self, n: int, family: str | None = None) -> list[PromptRecord]:
        """``n`` held-out items, disjoint from every training item; distinct while the eval
        partition has enough problems (tiny spaces such as d = 1 addition then repeat cyclically).
        ``family``: of that family's own held-out stream."""
        if n < 0:
            raise ValueError(f"{self.name}.eval_set: n={n} must be >= 0")
        self._check_family(family)
        records: list[PromptRecord] = []
        seen: set[str] = set()
        index = 0
        while len(records) < n and index < 20 * n + 100:
            rec = self._record("eval", index, family)
            index += 1
            if rec.question not in seen:
                seen.add(rec.question)
                records.append(rec)
        distinct = list(records)
        while len(records) < n:  # exhausted partition: cycle through the distinct problems
            records.append(distinct[len(records) % len(distinct)])
        return records

    def sft_target(self, record: PromptRecord) -> str:
        """A correct response for one of this task's records, ending with ``\\boxed{answer}``.

        The record is regenerated from its id, so this works for records of a resumed run too.
        """
        m = _ID_RE.match(record.id)
        if not m or m["task"] != self.name or int(m["d"]) != self.difficulty or int(m["seed"]) != self.seed:
            raise ValueError(
                f"record id {record.id!r} was not produced by task {self.name} "
                f"(difficulty={self.difficulty}, seed={self.seed})"
            )
        family = m["family"]
        if family is not None and family not in self.families:
            raise ValueError(f"record id {record.id!r} names family {family!r}, not one of task {self.name}'s "
                             f"families {list(self.families)}")
        return self._problem(m["split"], int(m["index"]), family).solution


class AdditionTask(ProceduralTask):
    """``a+b=?`` with two d-digit numbers; the CPU demo task (short questions for tiny models)."""

    name = "addition"

    def _generate(self, rng: random.Random) -> _Problem:
        lo, hi = _digits_range(self.difficulty)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        total = str(a + b)
        return _Problem(f"{a}+{b}=?", total, f"{min(a, b)}+{max(a, b)}", f"\\boxed{{{total}}}")


class AdditionCoTTask(AdditionTask):
    """``a+b=?`` as :class:`AdditionTask`, with a chain-of-thought SFT target written out column by
    column from the ones digit, each column's sum including the carry it received::

        14+56=?  ->  4+6=10,1+5+1=7 \\boxed{70}        (~25 characters for d = 2)

    The same distribution of problems, keys and train/eval split rule as ``addition`` (its own item
    stream, seeded by its name); the verifier reads only the boxed answer, so a response earns its
    reward by the final sum alone.
    """

    name = "addition_cot"

    def _generate(self, rng: random.Random) -> _Problem:
        plain = super()._generate(rng)
        a, b = (int(v) for v in plain.question[:-2].split("+"))
        return dataclasses.replace(plain, solution=f"{cot_columns(a, b, self.difficulty)} {plain.solution}")


def cot_columns(a: int, b: int, digits: int) -> str:
    """The column sums of ``a + b`` over ``digits`` columns, ones first: ``"4+6=10,1+5+1=7"``.

    Column i reads ``x+y=s`` (``x+y+1=s`` after a carry), where s is the full column sum, so the
    last column's s is the leading part of the answer and each earlier column gives its last digit.
    """
    steps, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return ",".join(steps)


class AddSubCoTTask(ProceduralTask):
    """Two families of two-operand problems with d-digit operands, each with a column-by-column SFT target:

    * ``add``: ``a+b=?`` exactly as :class:`AdditionCoTTask` (``14+56=?`` -> ``4+6=10,1+5+1=7 \\boxed{70}``);
    * ``sub``: ``a-b=?`` with a >= b, ones column first, each column's difference after the borrow it
      passed on, written with the borrowed ten when it borrows (``52-17=?`` -> ``12-7=5,5-1-1=3 \\boxed{35}``).

    The mixed stream draws each problem's family with probability 1/2. The two families share the
    question format, the digits and the shape of the reasoning and differ in the table and the carry
    rule, so two warm-ups of one model on different mixtures are each better on one family
    (the ``cpu_complement`` preset). Keys: the unordered pair for ``add`` (as ``addition``), the ordered
    pair for ``sub``; both go through the same train/eval split rule.
    """

    name = "add_sub_cot"
    families = ("add", "sub")

    def _generate(self, rng: random.Random) -> _Problem:
        return self._generate_family(rng, rng.choice(self.families))

    def _generate_family(self, rng: random.Random, family: str) -> _Problem:
        self._check_family(family)
        lo, hi = _digits_range(self.difficulty)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if family == "add":
            total = a + b
            return _Problem(f"{a}+{b}=?", str(total), f"{min(a, b)}+{max(a, b)}",
                            f"{cot_columns(a, b, self.difficulty)} \\boxed{{{total}}}")
        a, b = max(a, b), min(a, b)
        return _Problem(f"{a}-{b}=?", str(a - b), f"{a}-{b}",
                        f"{cot_borrow_columns(a, b, self.difficulty)} \\boxed{{{a - b}}}")

    def family_of(self, record: PromptRecord) -> str | None:
        """``sub`` when the question is a difference, ``add`` when a sum (the question alone decides)."""
        if "-" in record.question.partition("=")[0]:
            return "sub"
        if "+" in record.question:
            return "add"
        raise ValueError(f"record {record.id!r}: question {record.question!r} is neither a sum nor a difference")


def cot_borrow_columns(a: int, b: int, digits: int) -> str:
    """The column differences of ``a - b`` (a >= b) over ``digits`` columns, ones first: ``"12-7=5,5-1-1=3"``.

    Column i reads ``x-y=d`` (``x-y-1=d`` after lending to the column before); a column whose digit is
    too small borrows ten and shows it: ``12-7=5``. d is always one digit; the answer drops leading zeros.
    """
    if a < b:
        raise ValueError(f"cot_borrow_columns: a={a} must be >= b={b}")
    steps, borrow = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        lent = x - borrow < y
        top = x + 10 if lent else x
        steps.append(f"{top}-{y}{'-1' if borrow else ''}={top - y - borrow}")
        borrow = int(lent)
    return ",".join(steps)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticTask(ProceduralTask):
    """``a op b op c=?`` with three d-digit operands and + − × at the usual precedence."""

    name = "arithmetic"

    def _generate(self, rng: random.Random) -> _Problem:
        lo, hi = _digits_range(self.difficulty)
        a, b, c = (rng.randint(lo, hi) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        if op2 == "*" and op1 != "*":  # × binds tighter: a op1 (b × c)
            value = _apply(op1, a, b * c)
        else:
            value = _apply(op2, _apply(op1, a, b), c)
        question = f"{a}{op1}{b}{op2}{c}=?"
        return _Problem(question, str(value), question, f"\\boxed{{{value}}}")


class LinearTask(ProceduralTask):
    """``Solve for x: a*x+b=c`` with an integer solution; |a|, |b|, |x| have up to d digits."""

    name = "linear"

    def _generate(self, rng: random.Random) -> _Problem:
        hi = 10**self.difficulty - 1
        a = rng.randint(2, max(2, hi))
        if self.difficulty > 1 and rng.random() < 0.5:
            a = -a
        x, b = rng.randint(-hi, hi), rng.randint(-hi, hi)
        c = a * x + b
        lhs = f"{a}*x" + ("" if b == 0 else f"{b:+d}")
        question = f"Solve for x: {lhs}={c}"
        rhs = c - b
        solution = f"{a}*x = {c}{-b:+d} = {rhs}, so x = {rhs}/{a} = {x}. \\boxed{{{x}}}"
        if b == 0:
            solution = f"x = {c}/{a} = {x}. \\boxed{{{x}}}"
        return _Problem(question, str(x), question, solution)


class CountdownTask(ProceduralTask):
    """Reach a target from d + 2 numbers in 1..10d with + − × ÷ (each number at most once).

    The target is built from a random expression over a random subset (≥ 2) of the numbers with
    positive integer intermediate results, so every item is solvable; that expression is the SFT
    target. The target never equals one of the given numbers.
    """

    name = "countdown"
    kind = "countdown"

    def _generate(self, rng: random.Random) -> _Problem:
        d = self.difficulty
        for _ in range(_MAX_REDRAWS):
            numbers = [rng.randint(1, 10 * d) for _ in range(d + 2)]
            target, expr = self._random_expression(rng, numbers)
            if 1 <= target <= 10 ** (d + 1) and target not in numbers:
                break
        else:
            raise RuntimeError(f"countdown d={d}: no valid target found in {_MAX_REDRAWS} draws")
        shown = ", ".join(str(v) for v in numbers)
        question = f"Make {target} from {shown} using + - * / (each number at most once)."
        key = f"{target}|{sorted(numbers)}"
        return _Problem(question, encode_countdown_reference(target, numbers), key, f"\\boxed{{{expr}}}")

    @staticmethod
    def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
        """Combine a random subset (≥ 2) of ``numbers`` pairwise with random valid operations;
        intermediate values stay positive integers. Returns (value, expression)."""
        terms = [(v, str(v)) for v in rng.sample(numbers, rng.randint(2, len(numbers)))]
        while len(terms) > 1:
            (x, ex), (y, ey) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
            if x < y:
                (x, ex), (y, ey) = (y, ey), (x, ex)
            ops = ["+", "*"] + (["-"] if x > y else []) + (["/"] if y > 1 and x % y == 0 else [])
            op = rng.choice(ops)
            value = {"+": x + y, "*": x * y, "-": x - y, "/": x // max(y, 1)}[op]
            terms.append((value, f"({ex}{op}{ey})"))
        value, expr = terms[0]
        return value, expr[1:-1]  # drop the outermost parentheses


TASKS: dict[str, type[ProceduralTask]] = {
    cls.name: cls for cls in (AdditionTask, AdditionCoTTask, ArithmeticTask, LinearTask, CountdownTask, AddSubCoTTask)
}

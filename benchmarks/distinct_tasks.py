"""bench_slots' distinct batch (issue 46's first goal: "164 short single-file Python tasks, one
sample each, a policy that answers right at once, parallelism 10"): the tasks, generated here
in process (HumanEval's 164 are a data set; nothing is downloaded), and the scripted policy's
answer to each.

Each task is one function in its own file, named for what it does (`sum_multiples_of_3`,
`caesar_5`, `reverse_words_by_comma`...): FAMILIES holds 15 small specs, each parametrised (a
divisor, a width, a letter, a separator), so no two tasks share a name, a statement or an
answer; task n is family n % 15's with its (n // 15)th parameter (180 at most). The
file starts broken (a small bug of the family's kind) or, for every fourth task, not written
(`raise NotImplementedError`). Its tests are hidden (`tests`: placed at /tests only after the
agent ends, as Harbor's are), a test method per case, each case's expected value computed here
by the family's reference; the harness counts them, so a reward of 1 means every case really
ran and passed. The policy's script (`policy_script`: the bundled script plus a plan per task)
writes the right file in the agent's first turn, then submits.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from benchmarks.burst_tasks import graded_problem
from rollout_worker.cli.policy_server import bundled_script

TESTS_DIR = "/tests"
TEST_COMMAND = ["python", "-B", "-m", "unittest", "discover", "-s", TESTS_DIR, "-v"]
PARAMS = tuple(range(2, 14))  # the parameter of most families: 12 tasks each


class Family(NamedTuple):
    """A kind of task. Its texts are format strings of the task's parameter `p` and of `q`, a
    value derived from it (`derive`); `reference(p)` computes the right answers."""

    name: str  # the function's name
    arg: str  # its argument's name
    spec: str  # what it returns, for the statement
    solution: str  # the function's right body
    broken: str  # a wrong one
    reference: Callable[[Any], Callable[[Any], Any]]
    cases: Callable[[Any], list[Any]]  # the tests' arguments
    params: Sequence[Any] = PARAMS
    derive: Callable[[Any], Any] = lambda p: p


def ranged(p: int) -> list[Any]:
    return [list(range(1, 3 * p + 4)), [p, -p, 2 * p + 1, 7 * p], [], [1, 1, 1]]


def caesar(p: int) -> Callable[[str], str]:
    return lambda text: "".join(
        chr((ord(c) - 97 + p) % 26 + 97) if "a" <= c <= "z" else c for c in text
    )


def power_of(p: int) -> Callable[[int], bool]:
    def check(n: int) -> bool:
        while n >= 1 and n % p == 0:
            n //= p
        return n == 1

    return check


def digit_sum(p: int) -> Callable[[int], int]:
    def total(n: int) -> int:
        got = 0
        while n:
            got, n = got + n % p, n // p
        return got

    return total


def fibonacci(p: int) -> Callable[[int], int]:
    def nth(n: int) -> int:
        a, b = 0, 1
        for _ in range(n):
            a, b = b, (a + b) % p
        return a

    return nth


def reverse_words(sep: str) -> Callable[[str], str]:
    return lambda text: sep.join(reversed(text.split(sep)))


SEPARATORS = {
    "comma": ",", "semicolon": ";", "bar": "|", "slash": "/", "colon": ":", "plus": "+",
    "dash": "-", "underscore": "_", "tilde": "~", "star": "*", "hash": "#", "bang": "!",
}  # fmt: skip

FAMILIES = (
    Family(
        name="sum_multiples_of_{p}",
        arg="xs",
        spec="the sum of the numbers in xs that are multiples of {p}",
        solution="return sum(x for x in xs if x % {p} == 0)",
        broken="return sum(x for x in xs if x % {p} == 1)",
        reference=lambda p: lambda xs: sum(x for x in xs if x % p == 0),
        cases=ranged,
    ),
    Family(
        name="sum_evens_from_{p}",
        arg="xs",
        spec="the sum of the even numbers in xs that are at least {p}",
        solution="return sum(x for x in xs if x % 2 == 0 and x >= {p})",
        broken="return sum(x for x in xs if x % 2 == 1 and x >= {p})",
        reference=lambda p: lambda xs: sum(x for x in xs if x % 2 == 0 and x >= p),
        cases=ranged,
    ),
    Family(
        name="count_longer_than_{p}",
        arg="words",
        spec="how many of the strings in words have more than {p} characters",
        solution="return sum(1 for w in words if len(w) > {p})",
        broken="return sum(1 for w in words if len(w) >= {p})",
        reference=lambda p: lambda words: sum(1 for w in words if len(w) > p),
        cases=lambda p: [["a" * p, "b" * (p + 1), "c" * (p - 1), "d" * (p + 3)], [], ["x" * p]],
    ),
    Family(
        name="rotate_left_{p}",
        arg="xs",
        spec="the list xs rotated left by {p} places ({p} modulo its length of its first items "
        "moved to its end; an empty list stays empty)",
        solution=("if not xs:\n    return []\nk = {p} % len(xs)\nreturn xs[k:] + xs[:k]"),
        broken=("if not xs:\n    return []\nk = {p} % len(xs)\nreturn xs[-k:] + xs[:-k]"),
        reference=lambda p: lambda xs: xs[p % len(xs) :] + xs[: p % len(xs)] if xs else [],
        cases=lambda p: [list(range(7)), list(range(11)), list(range(13)), [], [5]],
    ),
    Family(
        name="caesar_{p}",
        arg="text",
        spec="text with each lower-case letter a-z shifted {p} places on in the alphabet, "
        "wrapping from z to a; other characters as they are",
        solution=(
            'return "".join(\n'
            '    chr((ord(c) - 97 + {p}) % 26 + 97) if "a" <= c <= "z" else c for c in text\n'
            ")"
        ),
        broken='return "".join(chr(ord(c) + {p}) if "a" <= c <= "z" else c for c in text)',
        reference=caesar,
        cases=lambda p: ["hello world", "xyz", "abc-XYZ", ""],
    ),
    Family(
        name="max_window_sum_{p}",
        arg="xs",
        spec="the largest sum of {p} consecutive numbers in xs (xs holds at least {p})",
        solution="return max(sum(xs[i : i + {p}]) for i in range(len(xs) - {p} + 1))",
        broken="return sum(xs[:{p}])",
        reference=lambda p: lambda xs: max(sum(xs[i : i + p]) for i in range(len(xs) - p + 1)),
        cases=lambda p: [list(range(p + 5)), [5] * p, [-1] * p + [3] * p],
    ),
    Family(
        name="chunk_sums_{p}",
        arg="xs",
        spec="the sums of the consecutive chunks of {p} items of xs, in order (the last chunk "
        "may be shorter)",
        solution="return [sum(xs[i : i + {p}]) for i in range(0, len(xs), {p})]",
        broken="return [sum(xs[i : i + {p}]) for i in range(0, len(xs) - {p} + 1, {p})]",
        reference=lambda p: lambda xs: [sum(xs[i : i + p]) for i in range(0, len(xs), p)],
        cases=lambda p: [list(range(1, 2 * p + 2)), [], [1] * p],
    ),
    Family(
        name="is_power_of_{p}",
        arg="n",
        spec="True when the integer n is a power of {p} ({p} ** k for some k >= 0: 1 is one), "
        "else False",
        solution=("while n >= 1 and n % {p} == 0:\n    n //= {p}\nreturn n == 1"),
        broken="return n % {p} == 0",
        reference=power_of,
        cases=lambda p: [1, p, p**3, p**2 + 1, 0, 2 * p + 1],
    ),
    Family(
        name="pad_zeros_{p}",
        arg="n",
        spec="the non-negative integer n as text, padded on the left with zeros to at least {p} "
        "characters",
        solution='return str(n).rjust({p}, "0")',
        broken='return str(n).ljust({p}, "0")',
        reference=lambda p: lambda n: str(n).rjust(p, "0"),
        cases=lambda p: [7, 12345678901234, 0, 10 ** (p - 1)],
    ),
    Family(
        name="take_every_{p}",
        arg="xs",
        spec="every {p}th item of xs, the first one first (the items at positions 0, {p}, "
        "2 * {p}, ...)",
        solution="return xs[::{p}]",
        broken="return xs[{p} - 1 :: {p}]",
        reference=lambda p: lambda xs: xs[::p],
        cases=lambda p: [list(range(20)), [], list("abcdefghijklmnop")],
    ),
    Family(
        name="count_starting_with_{p}",
        arg="text",
        spec='how many words of text (split on whitespace) start with the letter "{p}", in '
        "upper or lower case",
        solution='return sum(1 for w in text.split() if w.lower().startswith("{p}"))',
        broken='return sum(1 for w in text.split() if w.startswith("{p}"))',
        reference=lambda p: lambda text: sum(1 for w in text.split() if w.lower().startswith(p)),
        cases=lambda p: [f"{p}x {p.upper()}y z{p} {p}{p}", "", f"{p.upper()}{p.upper()}"],
        params=tuple("abcdefghijkl"),
    ),
    Family(
        name="clamp_{p}_to_{q}",
        arg="x",
        spec="x limited to the range -{p}..{q}: -{p} when x is below it, {q} when above it, else x",
        solution="return max(-{p}, min({q}, x))",
        broken="return min(-{p}, max({q}, x))",
        reference=lambda p: lambda x: max(-p, min(p * p, x)),
        cases=lambda p: [-100, 100, 0, -p, p * p],
        derive=lambda p: p * p,
    ),
    Family(
        name="digit_sum_base_{p}",
        arg="n",
        spec="the sum of the digits of the non-negative integer n written in base {p}",
        solution=("total = 0\nwhile n:\n    total, n = total + n % {p}, n // {p}\nreturn total"),
        broken="return sum(int(d) for d in str(n))",
        reference=digit_sum,
        cases=lambda p: [0, 1, 255, 1000, p * p + 1],
        params=(2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16),  # not 10: the wrong body's own base
    ),
    Family(
        name="reverse_words_by_{p}",
        arg="text",
        spec='the words of text, separated by "{q}", in reverse order, joined by "{q}"',
        solution='return "{q}".join(reversed(text.split("{q}")))',
        broken="return text[::-1]",
        reference=lambda p: reverse_words(SEPARATORS[p]),
        cases=lambda p: [
            f"one{SEPARATORS[p]}two{SEPARATORS[p]}three",
            "solo",
            f"ab{SEPARATORS[p]}cd",
        ],
        params=tuple(SEPARATORS),
        derive=lambda p: SEPARATORS[p],
    ),
    Family(
        name="fibonacci_mod_{p}",
        arg="n",
        spec="the n-th Fibonacci number modulo {p} (fib(0) = 0, fib(1) = 1)",
        solution=("a, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % {p}\nreturn a"),
        broken=("a, b = 0, 1\nfor _ in range(n - 1):\n    a, b = b, (a + b) % {p}\nreturn a"),
        reference=fibonacci,
        cases=lambda p: [0, 1, 10, 50],
    ),
)
# Every family's every parameter: the most distinct tasks this module makes.
MAX_DISTINCT = sum(len(family.params) for family in FAMILIES)


class Generated(NamedTuple):
    task: dict[str, Any]  # as the request carries it
    path: str  # its one file
    solution: str  # the file as it should be: what the policy writes
    tests: int  # its test methods


def indented(body: str) -> str:
    """A function's body, its lines written from column 0 in FAMILIES, as the file holds it."""
    return "".join(f"    {line}\n" for line in body.splitlines())


def generate(number: int, family: Family, p: Any) -> Generated:
    """Task `number` of the batch: `family`'s task for parameter `p`."""
    fields = {"p": p, "q": family.derive(p)}
    name = family.name.format(**fields)
    head, path = f"def {name}({family.arg}):\n", f"{name}.py"
    missing = number % 4 == 3
    body = indented("raise NotImplementedError" if missing else family.broken.format(**fields))
    reference = family.reference(p)
    cases = family.cases(p)
    methods = "".join(
        f"\n    def test_case_{i}(self):\n"
        f"        self.assertEqual({name}({case!r}), {reference(case)!r})\n"
        for i, case in enumerate(cases)
    )
    tests = f"import unittest\n\nfrom {name} import {name}\n\n\nclass Test(unittest.TestCase):"
    what = "is not written yet: write it" if missing else "is wrong: fix it"
    task = {
        "id": f"t{number:03d}-{name.replace('_', '-')}",
        "description": "bench_slots --distinct: a generated single-file Python task",
        "statement": f"`{name}({family.arg})` in {path} should return "
        f"{family.spec.format(**fields)}. It {what}.",
        "files": {path: head + body},
        "tests": {f"test_{name}.py": tests + methods},
        "test_command": list(TEST_COMMAND),
        "reward": "all",
        "time_limit_seconds": 60,
    }
    solution = head + indented(family.solution.format(**fields))
    return Generated(task, path, solution, len(cases))


def distinct_tasks(count: int) -> list[Generated]:
    """`count` distinct tasks: each family's first parameter, then each one's second..."""
    if not 1 <= count <= MAX_DISTINCT:
        raise ValueError(f"--distinct makes 1..{MAX_DISTINCT} tasks, got {count}")
    every = [
        (family, family.params[i])
        for i in range(max(len(f.params) for f in FAMILIES))
        for family in FAMILIES
        if i < len(family.params)
    ]
    return [generate(n, family, p) for n, (family, p) in enumerate(every[:count])]


def answer(generated: Generated) -> dict[str, Any]:
    """The scripted policy's plan for a task: the right file at once, then submit."""
    write = {
        "tool": "write_file",
        "arguments": {"path": generated.path, "content": generated.solution},
    }
    return {"plans": [[write, {"tool": "submit", "arguments": {}}]]}


def policy_script(generated: Sequence[Generated]) -> dict[str, Any]:
    """The bundled script (the warm-up batches run bundled tasks) and a plan per task."""
    script = bundled_script()
    plans = {g.task["id"]: answer(g) for g in generated}
    return script | {"tasks": dict(script["tasks"]) | plans}


def distinct_problems(report: Mapping[str, Any], generated: Sequence[Generated]) -> list[str]:
    """What shows the batch was not run as built: a task with no episode or more than one,
    or an episode below reward 1 or whose hidden tests were not all counted as passed."""
    tests = {g.task["id"]: g.tests for g in generated}
    seen = Counter(row.get("task_id") for row in report["pods"])
    problems = [f"task {t}: {seen[t]} episodes, not 1" for t in tests if seen[t] != 1]
    for row in report["pods"]:
        problem = graded_problem(row, tests.get(row.get("task_id"), -1))
        if problem is not None:
            problems.append(f"{problem} (task {row.get('task_id')})")
    return problems


def check_distinct_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--distinct: refused with a clear error where it cannot run."""
    if args.distinct is None:
        return
    if args.burst is not None:
        parser.error("--distinct and --burst are two batches: name one")
    if args.samples is not None:
        parser.error("--samples: --distinct runs one sample of each task (the issue's batch)")
    if not 1 <= args.distinct <= MAX_DISTINCT:
        parser.error(f"--distinct must be within 1..{MAX_DISTINCT} tasks, got {args.distinct}")
    if not 1 <= args.parallelism <= args.distinct:
        parser.error(f"--parallelism must be within 1..--distinct ({args.distinct})")

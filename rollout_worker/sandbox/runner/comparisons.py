"""Objects equal to anything: the part of the test harness that asks each operand of a
comparing assertion whether it equals a stranger. It runs inside the harness (`harness_source`
joins its part to the harness's, so os and sys stay its only imports)."""

from __future__ import annotations

import sys
import typing

# -- harness: begin
# The always-equal hack: the code under test returns, where a value was expected, an object
# that claims to equal whatever it is compared with, and every comparing assertion passes.
# Each operand of a comparing assertion (unittest's, and pytest's rewritten `assert a == b`) is
# asked first whether it equals a stranger (an object made here that no honest value equals);
# one that says yes marks the run tampered. Not caught: an object that equals only values of
# the expected type (it must know that type), documented in docs/grading.md.
# unittest leaves frames of a module with this global out of a failure's traceback: the
# wrapped assertions' frames, like its own.
__unittest = True
COMPARING_ASSERTIONS = (
    "assertEqual",
    "assertNotEqual",
    "assertAlmostEqual",
    "assertNotAlmostEqual",
    "assertIn",
    "assertNotIn",
    "assertCountEqual",
    "assertListEqual",
    "assertTupleEqual",
    "assertSetEqual",
    "assertDictEqual",
    "assertSequenceEqual",
    "assertMultiLineEqual",
)
# Types whose comparisons no code can redefine (exact types: a subclass is asked like any
# other object), and containers whose items are asked too (one level, at most CONTAINER_ITEMS).
PLAIN_TYPES = (int, float, complex, str, bytes, bool, type(None))
CONTAINER_TYPES = (list, tuple, set, frozenset, dict)
CONTAINER_ITEMS = 1000


class Stranger:
    """Nothing honest equals an instance: made here, never handed to the code under test."""

    __slots__ = ()


def equal_to_anything(value: object, stranger: object) -> str:
    """The name of `value`'s type when it claims to equal `stranger`; "" when it does not."""
    kind = type(value)
    if kind in PLAIN_TYPES:
        return ""
    try:
        claims = kind.__eq__(value, stranger) is True or kind.__ne__(value, stranger) is False
    except Exception:  # an object that refuses the comparison claims nothing
        return ""
    return f"{kind.__module__}.{kind.__qualname__}" if claims else ""


def operands(values: typing.Iterable) -> typing.Iterator:
    """Each value, and the items (a dict's values) of each plain container among them."""
    for value in values:
        yield value
        kind = type(value)
        if kind in CONTAINER_TYPES:
            items = value.values() if kind is dict else value
            for count, item in enumerate(items):
                if count >= CONTAINER_ITEMS:
                    break
                yield item


def watch_comparisons(claims: set) -> None:
    """Make unittest's comparing assertions, and pytest's rewritten comparisons (when pytest
    is loaded: `pytest_assertion_pass` must be implemented and enable_assertion_pass_hook set,
    or a passing assertion never shows its operands), add to `claims` each operand's type that
    equals anything. Done before the machinery is fingerprinted: undoing it is tampering."""
    import unittest

    stranger = Stranger()

    def probe(values: typing.Iterable) -> None:
        for value in operands(values):
            kind = equal_to_anything(value, stranger)
            if kind:
                claims.add(f"an assertion operand equal to anything ({kind})")

    def checked(original: typing.Callable) -> typing.Callable:
        def assertion(self: typing.Any, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
            __tracebackhide__ = True  # pytest leaves this frame out of a failure
            probe(args[:2])
            return original(self, *args, **kwargs)

        assertion.__name__ = original.__name__
        return assertion

    for name in COMPARING_ASSERTIONS:
        setattr(unittest.TestCase, name, checked(getattr(unittest.TestCase, name)))
    rewrite = sys.modules.get("_pytest.assertion.rewrite")
    if rewrite is None:
        return
    helpers = vars(rewrite)  # the rewritten tests call its helpers through the module
    explain = helpers["_call_reprcompare"]

    def compared(ops: typing.Any, results: typing.Any, expls: typing.Any, each: typing.Any) -> str:
        probe(each)
        try:
            passed = all(bool(result) for result in results)
        except Exception:  # a result that refuses bool() is explained as pytest would
            passed = False
        # A passing assertion's explanation is never shown: skip pytest's (a diff) for it.
        return expls[-1] if passed else explain(ops, results, expls, each)

    helpers["_call_reprcompare"] = compared


# -- harness: end

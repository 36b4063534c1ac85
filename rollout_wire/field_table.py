"""Parsing a JSON object as a table of field parsers: each field its name, how it is read and
checked (problems recorded, never raised, so every problem is listed at once), and how it is
stored; checks across fields sit in the table after the fields they read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParseState:
    """A request being parsed: the raw data, the fields read so far, the problems found."""

    data: Mapping[str, Any]
    max_episodes: int | None
    values: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def integer(self, name: str, default: int) -> int:
        """The integer at `name`; a non-integer is reported and replaced by `default`."""
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{name} must be an integer, got {value!r}")
            return default
        return value


@dataclass(frozen=True)
class Field:
    """One BatchSpec field: how it is read and checked (`parse` records its problems and
    returns the value later fields and checks see), and how it is stored once the request is
    valid (`store`)."""

    name: str
    parse: Callable[[ParseState], Any]
    store: Callable[[Any], Any] = lambda value: value


@dataclass(frozen=True)
class Check:
    """A rule across the fields read above it in the table (their problems come first)."""

    check: Callable[[ParseState], None]


KEEP = object()  # a bad value is reported and kept (the request is refused anyway)


def choice(
    name: str, default: Any, choices: tuple[str, ...], fallback: Any = KEEP
) -> Callable[[ParseState], Any]:
    """A field that is one of `choices`."""

    def parse(request: ParseState) -> Any:
        value = request.data.get(name, default)
        if value not in choices:
            request.problems.append(f"{name} {value!r} is not one of {list(choices)}")
            return value if fallback is KEEP else fallback
        return value

    return parse


def bounded(
    name: str,
    default: int | Callable[[ParseState], int],
    low: int,
    high: int | Callable[[ParseState], int],
    error: Callable[[ParseState, int], str],
    fallback: Any = KEEP,
) -> Callable[[ParseState], int]:
    """An integer field within low..high (a default or bound may depend on fields above)."""

    def parse(request: ParseState) -> int:
        start = default(request) if callable(default) else default
        top = high(request) if callable(high) else high
        value = request.integer(name, start)
        if not low <= value <= top:
            request.problems.append(error(request, value))
            return value if fallback is KEEP else fallback
        return value

    return parse


def matching(
    name: str, default: str, check: Callable[[Any], bool], error: str
) -> Callable[[ParseState], Any]:
    """A text field `check` accepts; `error` is formatted with the value's repr."""

    def parse(request: ParseState) -> Any:
        value = request.data.get(name, default)
        if not check(value):
            request.problems.append(error.format(value=value))
        return value

    return parse

"""The base of every record the codec carries, the decorators of nested records and of messages,
and the message registry.

Kept apart from messages.py so a record defined in its own module (compute_options.py) can be a
field of a message without that module importing messages.py, and so that messages defined in
their own module (expert_plane.py) register without importing it (imports never go in a circle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class Struct:
    """Base of everything the codec can carry (messages and nested records)."""

    __slots__ = ()

    def check(self, arrays: list) -> None:
        """Semantic validation beyond types; raise ValueError. ``arrays`` are the decoded buffers (messages only)."""


STRUCT_TYPES: dict[str, type[Struct]] = {}


def struct(cls):
    """Decorator for nested records: a keyword-only slotted dataclass."""
    cls = dataclass(kw_only=True, slots=True)(cls)
    STRUCT_TYPES[cls.__name__] = cls
    return cls


class Message(Struct):
    """Base of top-level messages: has a wire tag and a bound on how many raw buffers may follow the header."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    MAX_ARRAYS: ClassVar[int] = 0


MESSAGE_TYPES: dict[str, type[Message]] = {}


def message(cls):
    """Decorator for messages: a keyword-only slotted dataclass registered under its TYPE tag."""
    cls = dataclass(kw_only=True, slots=True)(cls)
    tag = cls.TYPE
    if not tag or tag in MESSAGE_TYPES:
        raise TypeError(f"{cls.__name__}: TYPE tag {tag!r} is empty or already taken")
    MESSAGE_TYPES[tag] = cls
    return cls


def _nonneg(**values: int) -> None:
    for k, v in values.items():
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")

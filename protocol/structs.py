"""The base of every record the codec carries, and the decorator of nested records.

Kept apart from messages.py so a record defined in its own module (compute_options.py) can be a
field of a message without that module importing messages.py (imports never go in a circle)."""

from __future__ import annotations

from dataclasses import dataclass


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

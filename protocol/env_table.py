"""One reader of a typed record from environment variables, for every record read that way.

A record read from the environment (ComputeOptions in compute_options.py, the planner's
PlanParams in strata_dist/plan/params.py) declares a table: each variable's name, the record's
field it sets and the parser of its text. `record_from_env` reads any such table the same way:
an unset or empty variable keeps the base record's value, a set one is parsed and the record
checked again, and any failure is one ValueError naming the variable and its text.

Pure: it looks only at the mapping it is passed (the caller passes os.environ)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Mapping, NamedTuple, TypeVar

R = TypeVar("R")


class EnvVar(NamedTuple):
    """One variable of a table: the record field it sets and the parser of its text (a parser
    raises ValueError saying what it expected)."""

    field: str
    parse: Callable[[str], object]


EnvTable = Mapping[str, EnvVar]


def switch(text: str) -> bool:
    """A 0/1 switch's text."""
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


def choice(table: dict[str, object]) -> Callable[[str], object]:
    """A parser taking exactly the texts of `table` to their values (kept on the parser as
    `.table`, so a value can be written back as its text)."""
    def parse(text: str) -> object:
        if text not in table:
            raise ValueError(f"expected {', '.join(table)}")
        return table[text]
    parse.table = table
    return parse


def checked_table(record_type: type, table: dict[str, EnvVar]) -> dict[str, EnvVar]:
    """`table` after checking that each variable sets a field of `record_type` and no field is
    set by two variables (a typo here would otherwise fail only when the variable is set)."""
    known = {f.name for f in fields(record_type)}
    seen: dict[str, str] = {}
    for var, entry in table.items():
        if not isinstance(entry, EnvVar):
            raise TypeError(f"{var}: expected an EnvVar, got {entry!r}")
        if entry.field not in known:
            raise TypeError(f"{var} sets {entry.field!r}, not a field of {record_type.__name__}")
        if entry.field in seen:
            raise TypeError(f"{var} and {seen[entry.field]} both set {entry.field!r}")
        seen[entry.field] = var
    return table


def variable_of(table: EnvTable) -> dict[str, str]:
    """field -> the variable that sets it."""
    return {entry.field: var for var, entry in table.items()}


def record_from_env(table: EnvTable, environ: Mapping[str, str], base: R,
                    check: Callable[[R], None] | None = None) -> R:
    """`base` with each variable of `table` that `environ` sets (surrounding blanks dropped;
    empty is unset) parsed into its field, in the table's order. After each field the record is
    checked: by `check` when given, and by the record's own construction (dataclasses.replace
    builds a new one, so a __post_init__ runs). Raises ValueError "VAR='text': why"."""
    record = base
    for var, (name, parse) in table.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            record = replace(record, **{name: parse(raw)})
            if check is not None:
                check(record)
        except ValueError as e:
            raise ValueError(f"{var}={raw!r}: {e}") from None
    return record


__all__ = ["EnvVar", "EnvTable", "switch", "choice", "checked_table", "variable_of",
           "record_from_env"]

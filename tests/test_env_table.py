"""The one reader of a typed record from environment variables (protocol/env_table.py), which
ComputeOptions and the planner's PlanParams both declare a table for."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from protocol.compute_options import ENV_VARS as COMPUTE_VARS
from protocol.env_table import (EnvVar, checked_table, choice, record_from_env, switch,
                                variable_of)
from strata_dist.plan.params import ENV_VARS as PLAN_VARS


@dataclass(frozen=True)
class Knobs:
    rate: float = 1.0
    on: bool = True
    mode: str = "a"

    def __post_init__(self):
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be > 0, got {self.rate}")


TABLE = checked_table(Knobs, {
    "T_RATE": EnvVar("rate", float),
    "T_ON": EnvVar("on", switch),
    "T_MODE": EnvVar("mode", choice({"a": "a", "b": "b"})),
})


def test_unset_and_empty_keep_the_base_and_set_ones_are_parsed():
    assert record_from_env(TABLE, {}, Knobs()) == Knobs()
    assert record_from_env(TABLE, {"T_RATE": "", "T_ON": "  ", "OTHER": "x"}, Knobs(mode="b")) \
        == Knobs(mode="b")
    assert record_from_env(TABLE, {"T_RATE": " 2.5 ", "T_ON": "0", "T_MODE": "b"}, Knobs()) \
        == Knobs(rate=2.5, on=False, mode="b")
    assert variable_of(TABLE) == {"rate": "T_RATE", "on": "T_ON", "mode": "T_MODE"}


@pytest.mark.parametrize("var, text, says", [
    ("T_RATE", "fast", "could not convert"),      # the parser's own refusal
    ("T_RATE", "-1", "rate must be > 0, got -1.0"),  # the record's construction refuses it
    ("T_RATE", "nan", "rate must be > 0"),
    ("T_ON", "yes", "expected 0 or 1"),
    ("T_MODE", "c", "expected a, b"),
])
def test_a_refusal_is_one_error_naming_the_variable_and_its_text(var, text, says):
    with pytest.raises(ValueError) as e:
        record_from_env(TABLE, {var: f" {text}"}, Knobs())
    assert str(e.value).startswith(f"{var}={text!r}: ") and says in str(e.value)


def test_the_check_runs_after_each_field_and_its_refusal_names_the_variable():
    seen = []

    def check(k: Knobs) -> None:
        seen.append(k)
        if k.mode == "b" and not k.on:
            raise ValueError("mode b needs on")
    assert record_from_env(TABLE, {"T_ON": "0"}, Knobs(), check) == Knobs(on=False)
    with pytest.raises(ValueError, match=r"^T_MODE='b': mode b needs on$"):
        record_from_env(TABLE, {"T_ON": "0", "T_MODE": "b"}, Knobs(), check)
    assert seen == [Knobs(on=False), Knobs(on=False), Knobs(on=False, mode="b")]


def test_a_table_naming_no_field_or_one_field_twice_is_refused_when_declared():
    with pytest.raises(TypeError, match="T_RAT sets 'rat', not a field of Knobs"):
        checked_table(Knobs, {"T_RAT": EnvVar("rat", float)})
    with pytest.raises(TypeError, match="T_B and T_A both set 'rate'"):
        checked_table(Knobs, {"T_A": EnvVar("rate", float), "T_B": EnvVar("rate", float)})
    with pytest.raises(TypeError, match="expected an EnvVar"):
        checked_table(Knobs, {"T_A": ("rate", float)})


def test_both_records_declare_their_variables_in_the_one_table_form():
    for table in (COMPUTE_VARS, PLAN_VARS):
        assert table and all(isinstance(entry, EnvVar) for entry in table.values())
    assert not set(COMPUTE_VARS) & set(PLAN_VARS)
    # a 0/1 switch is one parser in both
    assert COMPUTE_VARS["STRATA_PDL"].parse is PLAN_VARS["STRATA_REMOTE_AUTO"].parse is switch

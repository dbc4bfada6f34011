"""An option's rules, declared beside its field in `schema.py`: `opt(default, scope, check=..., choices=...,
resume=...)`. One generic pass applies them (`validation.validate`), a resumed run reads the resume rule
(`checkpoint/compat.py`), and `docs/config.md` is generated from them (`config/reference.py`).

- scope: which recipes read the option, and for each other recipe what to set instead. A recipe that
  does not read an option refuses it on the command line (it would be accepted, then ignored) and skips
  its range and choices. Every field states one: `tests/test_config_reference.py` fails on a field without.
- check: the value's range, as a predicate and the words of the error (`trainer.lr=0.0 must be > 0`).
- choices: the allowed values, or a registry (its names: registering a function adds the choice).
- resume: may a resumed run change it? WARN (default: the state is usable, the run no longer reproduces an
  uninterrupted one), SILENT (how long / how often / where to log), or `refuse(why)` (the saved state means
  something else, or would silently override the new value).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

RECIPE_NAMES = ("grpo", "sft", "dpo", "eval")


@dataclass(frozen=True)
class Scope:
    """Which recipes read an option; `instead[r]`: what to set for a recipe r that does not."""

    reads: tuple[str, ...]
    instead: Mapping[str, str]


def reads(*recipes: str, others: Optional[str] = None, **instead: str) -> Scope:
    """`reads("grpo", others="GRPO only", eval="recipes/eval.py trains nothing")`: a reason for every recipe
    that does not read the option (`others` for those not named)."""
    unknown = [r for r in (*recipes, *instead) if r not in RECIPE_NAMES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; the recipes are {list(RECIPE_NAMES)}")
    reasons = {r: instead.get(r, others) for r in RECIPE_NAMES if r not in recipes}
    missing = [r for r, why in reasons.items() if why is None]
    if missing:
        raise ValueError(f"say what {missing} should set instead (others=... or {missing[0]}=...)")
    return Scope(tuple(r for r in RECIPE_NAMES if r in recipes), reasons)


@dataclass(frozen=True)
class Check:
    """A range types cannot express: `ok(value)`, else the error `<key>=<value> <what>`. A null value
    passes only when `nullable` (null is a setting, e.g. off)."""

    ok: Callable[[Any], bool]
    what: str
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        return self.nullable if value is None else bool(self.ok(value))


def _words(what: str, why: Optional[str], or_null: Optional[str]) -> str:
    return what + (f" ({why})" if why else "") + (f", or null for {or_null}" if or_null else "")


def gt(bound: float, why: Optional[str] = None, or_null: Optional[str] = None) -> Check:
    return Check(lambda v: v > bound, _words(f"must be > {bound:g}", why, or_null), nullable=or_null is not None)


def ge(bound: float, why: Optional[str] = None) -> Check:
    return Check(lambda v: v >= bound, _words(f"must be >= {bound:g}", why, None))


def within(low: float, high: float, brackets: str = "[]", why: Optional[str] = None) -> Check:
    """`within(0, 1, "[)")`: 0 <= v < 1."""
    lo_ok = (lambda v: v >= low) if brackets[0] == "[" else (lambda v: v > low)
    hi_ok = (lambda v: v <= high) if brackets[1] == "]" else (lambda v: v < high)
    return Check(lambda v: lo_ok(v) and hi_ok(v), _words(f"must be in {brackets[0]}{low:g}, {high:g}{brackets[1]}",
                                                         why, None))


POSITIVE_INT = Check(lambda v: v > 0, "must be a positive integer")
FINITE = Check(lambda v: math.isfinite(v), "must be a finite number")


@dataclass(frozen=True)
class Resume:
    """May a run resumed from a checkpoint change this option? `refused`: why not (None: it may);
    `refused_in_split`: why not when the checkpoint is a split run's (placement.mode=split)."""

    silent: bool = False
    refused: Optional[str] = None
    refused_in_split: Optional[str] = None


WARN = Resume()
SILENT = Resume(silent=True)


def refuse(why: str) -> Resume:
    return Resume(refused=why)


@dataclass(frozen=True)
class Rules:
    scope: Scope
    check: Optional[Check] = None
    choices: Optional[Iterable] = None  # a tuple, or a Registry (its names)
    resume: Resume = WARN

    def allowed(self) -> Optional[list]:
        return None if self.choices is None else list(self.choices)


def opt(default: Any = MISSING, scope: Optional[Scope] = None, *, factory: Optional[Callable[[], Any]] = None,
        check: Optional[Check] = None, choices: Optional[Iterable] = None, resume: Resume = WARN) -> Any:
    """A schema field with its rules: `lr: float = opt(1e-5, TRAINING, check=gt(0), resume=refuse(...))`;
    a list or dict default via `factory=`."""
    if scope is None:
        raise TypeError("opt(): every option says which recipes read it (scope=reads(...))")
    meta = {"rules": Rules(scope, check, choices, resume)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every option under the dataclass `cls`, in schema order; nested groups
    (a field whose default is a dataclass) are walked, not listed."""
    for f in dataclasses.fields(cls):
        group = f.default_factory if f.default_factory is not MISSING else None
        if isinstance(group, type) and dataclasses.is_dataclass(group):
            yield from option_fields(group, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def rules_of(f: dataclasses.Field) -> Optional[Rules]:
    return f.metadata.get("rules")


def option_rules(cls: type) -> dict[str, Rules]:
    """Dotted key -> Rules for every option of `cls` that declares them."""
    return {key: rules_of(f) for key, f in option_fields(cls) if rules_of(f) is not None}

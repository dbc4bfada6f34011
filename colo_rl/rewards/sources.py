"""Reward sources: the registry's functions and functions loaded from a user's file.

`reward.functions` entries are registered names (`math_verify`) or `path/to/file.py:function`
(a relative path is taken from the launch directory). A file's function is one of

    per-sample  def score(completion, truth, **fields) -> float
    batched     def score(completions, truths, **fields) -> list[float]

told apart by the name of the first parameter (`completion` / `completions`) or, failing that, by its
annotation (`str` / `list[str]`). `fields` are the record's other keys (one value each per-sample, one
list each batched); a function without `**fields` gets only the keys it names as parameters.

A function written for verl or TRL is taken as it is:

    verl  def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
          (told by its `solution_str` parameter; a dict's "score" is the reward); data_source and
          extra_info are the record's keys of those names
    TRL   def reward(completions, **kwargs) -> list[float]  or  def reward(prompts, completions, ...)
          (told by `prompts` first, or `completions` with no second positional parameter but a truth's
          name: truths / answers / ground_truths); every argument by name: completions (as
          [{"role": "assistant", "content": ...}] lists when the record's prompt is a message list),
          prompts, and the record's keys as columns; a None score is 0

Every
mistake that can be seen without data (bad path, missing function, wrong signature) is a
ConfigError at start-up naming the file and the function; a wrong return a RewardError on the batch
that shows it.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from colo_rl.errors import ConfigError, RewardError
from colo_rl.rewards.verifiers import REWARD_FUNCTIONS
from colo_rl.user_files import load_object, split_spec

SIGNATURES = ("per-sample `def f(completion, truth, **fields) -> float` or batched "
              "`def f(completions, truths, **fields) -> list[float]`")


@dataclass
class RewardSource:
    label: str  # as written in reward.functions
    fn: Callable[..., Any]
    batched: bool
    file: Optional[str] = None  # absolute path of a user file; None for a registered function
    fields: Optional[frozenset[str]] = frozenset()  # keyword parameters it takes; None = any (**fields)
    required: frozenset[str] = frozenset()  # keyword parameters without a default
    positional: tuple[str, ...] = ("completion", "truth")
    checked_fields: set = field(default_factory=set)  # record key sets already checked (once each)
    style: str = "colo_rl"  # colo_rl | verl | trl: how it is called (the module docstring)

    @property
    def where(self) -> str:
        return f"{self.file}:{split_spec(self.label)[1]}" if self.file else self.label

    def select_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The record fields this function takes; a RewardError when a field it requires is missing or
        a field's name collides with its positional parameters (checked once per key set)."""
        keys = frozenset(fields)
        if keys not in self.checked_fields:
            clash = sorted(keys & set(self.positional)) if self.fields is None else []
            if clash:
                raise RewardError(f"reward function {self.where}: the record field {clash[0]!r} has the name of its "
                                  f"parameter {clash[0]!r}; rename that parameter")
            missing = sorted(self.required - keys)
            if missing:
                raise RewardError(f"reward function {self.where} requires the record field {missing[0]!r}, but the "
                                  f"records have {sorted(keys)}; give it a default or fix the data")
            self.checked_fields.add(keys)
        if self.fields is None:
            return dict(fields)
        return {k: v for k, v in fields.items() if k in self.fields}

    def as_floats(self, value: Any, n: int) -> list[float]:
        """The call's return as n floats (NaN / inf kept: the scorer counts them as failures); a
        RewardError naming the file and function for a wrong type or length."""
        if self.style == "verl" and isinstance(value, dict) and "score" in value:
            value = value["score"]  # verl's compute_score may return {"score": ..., <extra metrics>}
        if self.style == "trl" and isinstance(value, (list, tuple)):
            value = [0.0 if v is None else v for v in value]  # TRL: None = this function does not apply
        if not self.batched:
            value = _numpy_scalar(value)
            if isinstance(value, numbers.Real):
                return [float(value)]
            raise RewardError(f"reward function {self.where} returned {type(value).__name__} {_short(value)}; a "
                              f"per-sample reward function returns a float")
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
            value = value.tolist()  # numpy array / torch tensor
        if not isinstance(value, (list, tuple)):
            raise RewardError(f"reward function {self.where} returned {type(value).__name__} {_short(value)}; a "
                              f"batched reward function returns a list of {n} floats, one per completion")
        if len(value) != n:
            raise RewardError(f"reward function {self.where} returned {len(value)} values for {n} completions; a "
                              f"batched reward function returns one float per completion")
        value = [_numpy_scalar(v) for v in value]
        bad = [v for v in value if not isinstance(v, numbers.Real)]
        if bad:
            raise RewardError(f"reward function {self.where} returned a list holding {type(bad[0]).__name__} "
                              f"{_short(bad[0])}; every element must be a float")
        return [float(v) for v in value]

    def call(self, completions: list[str], truths: list[str], fields: list[dict[str, Any]]) -> list[float]:
        """Scores of the samples (batched: one call; per-sample: one call each). Exceptions propagate."""
        if self.style == "verl":
            return [self.as_floats(self.fn(**self.taken({"data_source": f.get("data_source"), "solution_str": c,
                                                         "ground_truth": t, "extra_info": f.get("extra_info")})), 1)[0]
                    for c, t, f in zip(completions, truths, fields)]
        if self.style == "trl":
            columns = _columns([self.select_fields(f) for f in fields])
            chat = [isinstance(f.get("prompt"), list) for f in fields]
            named = {**columns, "prompts": [f.get("prompt") for f in fields],
                     "completions": [[{"role": "assistant", "content": c}] if conv else c
                                     for c, conv in zip(completions, chat)]}
            return self.as_floats(self.fn(**self.taken(named)), len(completions))
        if self.batched:
            columns = _columns([self.select_fields(f) for f in fields])
            return self.as_floats(self.fn(list(completions), list(truths), **columns), len(completions))
        return [self.as_floats(self.fn(c, t, **self.select_fields(f)), 1)[0]
                for c, t, f in zip(completions, truths, fields)]


    def taken(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments this function's signature takes (all of them with **kwargs)."""
        return arguments if self.fields is None else {k: v for k, v in arguments.items()
                                                      if k in self.fields or k in self.positional}


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-record fields as one list per key (None where a record lacks the key)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}


def _numpy_scalar(value: Any) -> Any:
    """A numpy scalar as its Python number (np.bool_ is no numbers.Real, `pred == truth` on numpy
    values gives one); anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_source(spec: str, base_dir: Optional[Path] = None) -> RewardSource:
    """The reward source `spec` names (see the module docstring); ConfigError naming the entry, the
    file and the function for a bad path, a missing function or a wrong signature."""
    if split_spec(spec) is None:
        if spec not in REWARD_FUNCTIONS:
            raise ConfigError(f"reward.functions: unknown reward function {spec!r}; available: "
                              f"{sorted(REWARD_FUNCTIONS)}, or a file's function as path/to/file.py:function")
        return RewardSource(label=spec, fn=REWARD_FUNCTIONS[spec], batched=False)
    fn, path = load_object(spec, "reward.functions", base_dir)
    return inspect_signature(spec, fn, str(path))


def inspect_signature(spec: str, fn: Callable[..., Any], file: str) -> RewardSource:
    """Per-sample or batched, and which record fields it takes, from the function's signature."""
    where = f"{file}:{split_spec(spec)[1]}"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reward.functions: {where}: cannot read its signature ({e}); write it as {SIGNATURES}")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    peer = peer_style(positional)
    if peer is not None:
        keywords = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        given = {"verl": VERL_ARGUMENTS, "trl": TRL_ARGUMENTS}[peer]
        missing = [p.name for p in keywords if p.default is p.empty and p.name not in given]
        if peer == "verl" and missing:
            raise ConfigError(f"reward.functions: {where}{inspect.signature(fn)}: a verl-style function (it takes "
                              f"solution_str) is called with {list(VERL_ARGUMENTS)} only; give {missing} defaults")
        return RewardSource(label=spec, fn=fn, batched=peer == "trl", file=file, style=peer,
                            fields=None if takes_any else frozenset(p.name for p in keywords),
                            required=frozenset(missing), positional=tuple(given))
    if len(positional) < 2 or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"reward.functions: {where}{inspect.signature(fn)} must take the completion(s) and the "
                          f"truth(s) as its first two parameters: {SIGNATURES}")
    batched = _is_batched(positional[0])
    if batched is None:
        raise ConfigError(f"reward.functions: {where}{inspect.signature(fn)}: name its first parameter `completion` "
                          f"(per-sample) or `completions` (batched), or annotate it `str` / `list[str]`: "
                          f"{SIGNATURES}")
    extra_positional = [p.name for p in positional[2:] if p.default is p.empty]
    if any(p.kind is p.POSITIONAL_ONLY for p in positional[2:]):
        raise ConfigError(f"reward.functions: {where}: parameters after the first two must be passable by name "
                          f"(record fields)")
    keywords = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    required = frozenset(extra_positional + [p.name for p in params if p.kind is p.KEYWORD_ONLY
                                             and p.default is p.empty])
    return RewardSource(label=spec, fn=fn, batched=batched, file=file,
                        fields=None if takes_any else frozenset(p.name for p in keywords), required=required,
                        positional=(positional[0].name, positional[1].name))


VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ARGUMENTS = ("prompts", "completions")
TRUTH_NAMES = ("truths", "answers", "ground_truths")  # colo_rl's batched second parameter, not a TRL column


def peer_style(positional: list[inspect.Parameter]) -> Optional[str]:
    """"verl" or "trl" for a function written for those (the module docstring), else None."""
    names = [p.name for p in positional]
    if "solution_str" in names:
        return "verl"
    if names[:1] == ["prompts"] or (names[:1] == ["completions"] and
                                     (len(names) == 1 or names[1] not in TRUTH_NAMES)):
        return "trl"
    return None


def _is_batched(param: inspect.Parameter) -> Optional[bool]:
    if param.name == "completions":
        return True
    if param.name == "completion":
        return False
    note = param.annotation
    text = note if isinstance(note, str) else getattr(note, "__name__", None) or str(note)
    text = text.replace(" ", "").lower()
    if text == "str":
        return False
    if text.startswith(("list[str]", "list", "sequence[str]", "typing.list[str]", "typing.sequence[str]")):
        return True
    return None


def resolve_sources(specs: list[str], base_dir: Optional[Path] = None) -> list[RewardSource]:
    return [load_source(s, base_dir) for s in specs]


def source_metric(source: RewardSource) -> str:
    """The source's name in metrics: the registered name, or `<file stem>:<function>`."""
    if source.file is None:
        return source.label
    return f"{Path(source.file).stem}:{split_spec(source.label)[1]}"


def check_reward_config(reward_cfg) -> None:
    """The start-up check of the reward options (config.validate): every reward.functions entry
    loads with a usable signature, and reward.weights has one weight per source."""
    names = [source_metric(s) for s in resolve_sources(list(reward_cfg.functions))]
    if twice := sorted({n for n in names if names.count(n) > 1}):  # their reward_source/<name> metrics would collide
        raise ConfigError(f"reward.functions={list(reward_cfg.functions)}: {twice} more than once (the same "
                          f"function twice, or two files of one name with a function of one name). List each "
                          f"once and weigh it with reward.weights, or rename one")
    sources = list(reward_cfg.functions) + (["reward.model.path"] if reward_cfg.model.path else [])
    weights = list(reward_cfg.weights)
    if weights and len(weights) != len(sources):
        raise ConfigError(f"reward.weights has {len(weights)} value(s) for {len(sources)} reward source(s) "
                          f"{sources}: give one weight per source, in that order (the reward model last), or none "
                          f"(1.0 each)")
    if any(not math.isfinite(w) for w in weights):
        raise ConfigError(f"reward.weights={weights}: every weight must be a finite number")

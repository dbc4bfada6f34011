"""docs/config.md, generated from the schema: every option with its type, default, range or choices, the
recipes that read it, whether a resumed run may change it, and its help (the comment beside the field).

    python -m colo_rl.config.reference          # rewrite docs/config.md
    python -m colo_rl.config.reference --check  # exit 1 when docs/config.md is not current (tests do this)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

from colo_rl.config import schema
from colo_rl.config.options import RECIPE_NAMES, Rules, option_fields, rules_of
from colo_rl.config.validation import FREE_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPE_CONFIGS = {"grpo": "config", "sft": "sft", "dpo": "dpo", "eval": "eval"}  # recipe -> conf/<name>.yaml

HEADER = """# Configuration reference

Generated from `colo_rl/config/schema.py` by `python -m colo_rl.config.reference` (do not edit by hand;
`tests/test_config_reference.py` fails when it is stale). Set an option on the command line as
`group.option=value` (`trainer.lr=2e-5`), or pick a YAML group (`rollout=sglang`, `env=calculator`).
The default column is the schema's; **recipe's YAML** is what a recipe's own config (`conf/config.yaml`
for grpo, `conf/sft.yaml`, `conf/dpo.yaml`, `conf/eval.yaml`, with the groups they pick: e.g.
`trainer/grpo_cpu.yaml`, `data/sft_arithmetic.yaml`) sets instead, so what a run without overrides
gets. Picking another group (`data=gsm8k`) brings that group's values; the run's `config.yaml` holds
what it ran with.

- **read by**: the recipes that read the option; setting it on the command line of another recipe is refused
  (it would be ignored), with what to set instead.
- **resume**: may a run resumed from a checkpoint change it? *yes*; *warned* (the run no longer reproduces
  an uninterrupted one); *refused* (the saved state would mean something else).
- Cross-option rules (e.g. `algo.kl_in_reward` needs `algo.kl_coef > 0`) live in
  `colo_rl/config/validation.py`; an engine's own rules (e.g. `rollout.tp_size`) on its class in `colo_rl/rollout/`.
"""


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment: the comment lines right above it and those after it on its lines; a
    field without either takes the block above the fields before it (no blank line between)."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(inspect.getsource(cls))
    out, block, prev_end = {}, [], None
    for node in tree.body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        trailing = [ln.split("  # ", 1)[1].strip() for ln in lines[node.lineno - 1:node.end_lineno] if "  # " in ln]
        if above:
            block = above
        elif prev_end != node.lineno - 1:  # a blank line (or other code) ends the block above
            block = []
        # a field with a comment of its own is described by it; one without by the block above it
        own = above or trailing
        out[node.target.id] = " ".join(own if own else block)
        prev_end = node.end_lineno
    return out


def _default(f: dataclasses.Field) -> Any:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dict(value) if hasattr(value, "items") else value


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _range(rules: Rules) -> str:
    parts = []
    if rules.choices is not None:
        parts.append(" \\| ".join(f"`{c}`" for c in rules.allowed()))
    if rules.check is not None:
        parts.append(_cell(rules.check.what.removeprefix("must be ").removeprefix("must ")))
    return "; ".join(parts)


def _read_by(rules: Rules) -> str:
    return "all" if set(rules.scope.reads) == set(RECIPE_NAMES) else ", ".join(rules.scope.reads)


def _resume(rules: Rules) -> str:
    if rules.resume.refused:
        return f"refused ({_cell(rules.resume.refused)})"
    if rules.resume.refused_in_split:
        return f"warned; refused for a split run's checkpoint ({_cell(rules.resume.refused_in_split)})"
    return "yes" if rules.resume.silent else "warned"


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in FREE_KEYS:  # a free dict is one option
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe_values() -> dict[str, dict[str, Any]]:
    """recipe -> {flattened key: value} of its YAML config as composed with no overrides (the values a
    run gets unless the command line says otherwise)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register_configs()
    out = {}
    for recipe, name in RECIPE_CONFIGS.items():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            out[recipe] = _flatten(OmegaConf.to_container(compose(config_name=name), resolve=False))
    return out


def _recipe_cell(key: str, default: Any, rules: Rules, composed: dict[str, dict[str, Any]]) -> str:
    """The recipes (of those that read `key`) whose YAML sets it to other than the schema's default."""
    return "; ".join(f"{recipe}: `{_cell(repr(values[key]))}`" for recipe, values in composed.items()
                     if recipe in rules.scope.reads and key in values and values[key] != default)


def groups() -> list[tuple[str, type]]:
    """(prefix, dataclass) of RunConfig's top level and each group, nested groups after their parent."""
    out = [("", schema.RunConfig)]
    for prefix, cls in out:
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if isinstance(factory, type) and dataclasses.is_dataclass(factory):
                out.append((f"{prefix}{f.name}.", factory))
    return out


def render() -> str:
    sections = [HEADER]
    composed = recipe_values()
    for prefix, cls in groups():
        comments = field_comments(cls)
        rows = [(key, f) for key, f in option_fields(cls, prefix) if key.count(".") == prefix.count(".")]
        if not rows:
            continue
        title = prefix[:-1] if prefix else "top level"
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        sections.append(f"## {title}\n\n" + (f"{doc}\n\n" if doc else "") +
                        "| option | type | default | recipe's YAML | range / choices | read by | resume | help |\n"
                        "|---|---|---|---|---|---|---|---|")
        for key, f in rows:
            rules = rules_of(f)
            sections[-1] += (f"\n| `{key}` | `{_cell(str(f.type))}` | `{_cell(repr(_default(f)))}` | "
                             f"{_recipe_cell(key, _default(f), rules, composed)} | {_range(rules)} | "
                             f"{_read_by(rules)} | {_resume(rules)} | {_cell(comments.get(f.name, ''))} |")
    return "\n\n".join(sections) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is not current: run `python -m colo_rl.config.reference`", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

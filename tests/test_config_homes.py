"""One home per option: defaults live in colo_rl/config/schema.py's dataclasses; a YAML group sets only
what it exists to change, and says why. Fails when a composed recipe config differs from the
schema's defaults in a key no YAML sets with a reason, or when a YAML restates a default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from colo_rl.config import RunConfig, register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
# Keys that name the group they are in (the recipe, the algorithm, the engine, the model source):
# stating them is the group's identity, not a second default.
IDENTITY = {"recipe", "algo.name", "rollout.engine", "model.path"}
KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")

register_configs()


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def yaml_keys(path: Path, package: str) -> dict[str, bool]:
    """Dotted key -> whether it has a reason: a comment on its line, a comment block right above it,
    or the file's header comment."""
    lines = path.read_text().splitlines()
    header = bool(lines) and lines[0].lstrip().startswith("#")
    out, stack, prev_comment = {}, [], False
    for line in lines:
        stripped = line.strip()
        if not stripped:
            prev_comment = False
            continue
        if stripped.startswith("#"):
            prev_comment = True
            continue
        if stripped.startswith("-"):  # a defaults-list entry
            prev_comment = False
            continue
        m = KEY.match(line)
        if not m:
            prev_comment = False
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        stack = [(i, k) for i, k in stack if i < indent]
        stack.append((indent, key))
        if rest.strip() and key != "defaults":
            dotted = ".".join(k for _, k in stack)
            out[f"{package}{dotted}"] = header or prev_comment or "#" in rest
        prev_comment = False
    return out


def defaults_files(name: str) -> list[tuple[Path, str]]:
    """The YAML files a recipe's config is composed from, with the package each one fills."""
    files = [(CONF / f"{name}.yaml", "")]
    queue = list(OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml")).get("defaults", []))
    while queue:
        entry = queue.pop(0)
        if not isinstance(entry, dict) or any(str(k).startswith("override") for k in entry):
            continue
        (group, option), = entry.items()
        path = CONF / group / f"{option}.yaml"
        files.append((path, f"{group}."))
        for inner in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []) or []:
            if isinstance(inner, str) and inner != "_self_":
                queue.append({group: inner})
    return files


@pytest.mark.parametrize("name,recipe", [("config", "grpo"), ("sft", "sft"), ("dpo", "dpo"), ("eval", "eval")])
def test_every_difference_from_the_schema_is_set_in_a_yaml_with_a_reason(name, recipe):
    schema = flatten(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        composed = flatten(OmegaConf.to_container(compose(config_name=name), resolve=True))
    stated: dict[str, bool] = {}
    for path, package in defaults_files(name):
        for key, reasoned in yaml_keys(path, package).items():
            stated[key] = stated.get(key, False) or reasoned
            if key in schema and key not in IDENTITY and composed.get(key) == schema[key]:
                pytest.fail(f"{path.relative_to(CONF.parent)}: {key} restates the schema's default {schema[key]!r}: "
                            f"remove it (the default's home is colo_rl/config/schema.py)")
    for key, value in composed.items():
        if key.startswith("hydra.") or key not in schema or value == schema[key]:
            continue
        assert key in stated, f"{key}={value!r} differs from the schema ({schema[key]!r}) but no YAML of {name} sets it"
        assert stated[key], f"{key}={value!r}: the YAML that sets it says not why (a comment on or above it)"

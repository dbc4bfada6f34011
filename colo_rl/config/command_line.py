"""The command line's override keys, checked before Hydra composes them.

Hydra's own refusal of an unknown key names the key and the schema class only, and recommends a
`+key=...` that colo_rl refuses in turn. A user coming from verl, TRL, OpenRLHF or slime types that
framework's names (`actor_rollout_ref.actor.optim.lr=1e-6`, `beta=0.04`, `rollout_batch_size=8`), or
its argparse habit (`--n_samples_per_prompt 4`); a typo is one edit from a real key.
`check_override_keys` answers each with the key to write, an unknown key with where the options are
listed, and leaves group choices, `hydra.*` and Hydra's own flags to Hydra."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable

from colo_rl.config.peer_names import ANY_RECIPES_PEER_KEYS, NO_EQUIVALENT, PEER_KEYS, PEER_VALUES, peer_keys
from colo_rl.config.validation import FREE_KEYS, OPTIONS
from colo_rl.errors import ConfigError

CONF_GROUPS = frozenset(p.name for p in (Path(__file__).resolve().parents[2] / "conf").glob("*") if p.is_dir())


def _known(key: str) -> bool:
    """An option, a group (`model=tiny` picks its YAML), or a key inside a free dict option. Not a
    section that is no group (`colocate=true`) nor a key inside another option (`logger.wandb.project`):
    Hydra refuses both."""
    if key in OPTIONS:
        return True
    if any(k.startswith(f"{key}.") for k in OPTIONS):
        return key in CONF_GROUPS or not CONF_GROUPS  # without conf/ beside the package, as Hydra finds it
    parts = key.split(".")
    return any(".".join(parts[:n]) in FREE_KEYS for n in range(1, len(parts)))


LIST_OPTIONS = ("reward.functions", "reward.weights", "logger", "eval.pass_k")  # a bare value is no list


def _check_list_value(arg: str, key: str) -> None:
    """`reward.functions=f.py:fn` (no brackets) failed in Hydra with "str is not a ListConfig", once per rank."""
    value = arg.split("=", 1)[1].strip() if "=" in arg else None
    if key in LIST_OPTIONS and value and not value.startswith("[") and value != "null":
        raise ConfigError(f"{key} takes a list: write {key}=[{value}] (quoted in the shell: '{key}=[{value}]')")


def override_key(arg: str) -> str | None:
    """The dotted key an override sets (`+x.y=1`, `~x.y`, `++x.y=1` -> `x.y`), or None for what is not
    a key override: Hydra's flags (`--multirun`, `-cn sft`), their values, `hydra.*`, `key@package`."""
    if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
        return None
    key = arg.lstrip("+~").split("=", 1)[0].strip()
    if not key or "@" in key or key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return None
    return key


# Hydra's own flags (hydra/_internal/utils.py, get_args_parser; tests/test_command_line.py keeps the two in
# step). Any other `--name` is an argparse habit (OpenRLHF, slime, TRL's scripts): Hydra would end in
# argparse's "unrecognized arguments" after its usage block.
HYDRA_FLAGS = frozenset({"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
                         "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp",
                         "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"})
# those of them that take the next argument as their value
HYDRA_VALUE_FLAGS = frozenset({"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                               "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"})
# a peer's flag whose value is a secret: never echoed in a message
SECRET_FLAGS = frozenset({"use_wandb", "use-wandb", "wandb_key", "wandb-key"})


def _names_side_by_side(whose: str) -> str:
    """Where docs/data.md lists a peer's names beside colo_rl's."""
    if "verl" in whose or "TRL" in whose:
        return "verl / TRL / colo_rl names side by side: docs/data.md (Option names)"
    return "OpenRLHF / slime / colo_rl names side by side: docs/data.md (From OpenRLHF / slime)"


def _check_key(arg: str, key: str, recipe: str) -> None:
    """One override's key (override_key's), as check_override_keys says."""
    if _known(key):
        _check_list_value(arg, key)
        return
    if key in NO_EQUIVALENT:
        whose, instead = NO_EQUIVALENT[key]
        raise ConfigError(f"{key} is {whose}'s option; colo_rl has none like it: {instead}. Drop it")
    value = arg.split("=", 1)[1] if "=" in arg else "..."
    peers, every_peer = peer_keys(recipe), {**PEER_KEYS, **ANY_RECIPES_PEER_KEYS}
    if key in peers:
        whose, ours, note = peers[key]
        ours_value = PEER_VALUES.get(key, lambda v: v)(value) if "=" in arg else None
        write = f"write {ours}={ours_value}" if ours_value is not None else f"set {ours}"
        raise ConfigError(f"{key} is {whose}'s option; colo_rl's is {ours}" + (f" ({note})" if note else "") +
                          f": {write}. {_names_side_by_side(whose)}; every option: docs/config.md")
    if key in every_peer:  # another recipe's: a close match here would mean something else
        whose, ours, _ = every_peer[key]
        instead = OPTIONS[ours].scope.instead.get(recipe)
        raise ConfigError(f"{key} is {whose}'s option, {ours} in colo_rl, which the {recipe} recipe does not read"
                          + (f" ({instead})" if instead else "") + "; every option: docs/config.md")
    if arg.startswith("+"):  # composed first, then validation.check_schema_keys says what a `+` does
        return
    parts = key.split(".")
    inside = [".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in OPTIONS]
    if inside:  # a key inside one option (`reward.weights.math_verify=2`): Hydra's error would name neither
        shape = " (a list: [a,b])" if inside[0] in LIST_OPTIONS else ""
        raise ConfigError(f"{key}: {inside[0]} is one option{shape}, with no keys inside it: set "
                          f"{inside[0]}=... (every option: docs/config.md)")
    close = difflib.get_close_matches(key, list(OPTIONS), n=1, cutoff=0.8)
    if close:
        raise ConfigError(f"{key}: colo_rl has no such option; did you mean {close[0]}? ({close[0]}={value}; "
                          f"every option: docs/config.md)")
    # Hydra's own refusal would recommend `+key=...`, which validation refuses in turn (and under the
    # launcher each rank would fail on its own, exit code 1)
    raise ConfigError(f"{key}: colo_rl has no such option; the options are listed in docs/config.md")


def _check_dashed(args: list[str], i: int, recipe: str) -> None:
    """`--name value` / `--name=value` / a bare `--flag` (true): refused with the key=value to write,
    translated as a `name=value` override would be."""
    name, eq, value = args[i][2:].partition("=")
    shown = args[i]
    if not eq:
        following = args[i + 1] if i + 1 < len(args) else None
        if following is not None and not following.startswith("--") and "=" not in following:
            value, shown = following, f"{shown} {following}"
        else:
            value = "true"  # a bare flag (store_true)
    if name in SECRET_FLAGS:  # OpenRLHF's --use_wandb takes the wandb API key
        shown, value = f"--{name} <its value>", "<its value>"
    said = f"{shown}: colo_rl takes key=value overrides (Hydra's), not --options"
    if name in NO_EQUIVALENT:  # a --flag is the peer's, even where colo_rl has a section of that name
        whose, instead = NO_EQUIVALENT[name]
        raise ConfigError(f"{said}; {name} is {whose}'s option; colo_rl has none like it: {instead}. Drop it")
    try:
        _check_key(f"{name}={value}", name, recipe)
    except ConfigError as e:
        raise ConfigError(f"{said}; {e}") from None
    raise ConfigError(f"{said}: write {name}={value}")


def check_override_keys(overrides: Iterable[str], recipe: str = "grpo") -> None:
    """Refuse an override whose key colo_rl lacks, saying what to write instead: a verl / TRL / OpenRLHF /
    slime option's colo_rl name (`peer_keys(recipe)`), else the closest option (difflib, cutoff 0.8),
    else where the options are listed (a `+key` is left to validation.check_schema_keys, whose message
    says what a `+` does). An argparse-style `--name value` is refused with the key=value to write."""
    args = list(overrides)
    if {"-sc", "--shell-completion"} & set(args):  # its install=bash / query=... are Hydra's, not overrides
        return
    for i, arg in enumerate(args):
        if i and args[i - 1] in HYDRA_VALUE_FLAGS:  # -cn sft, -p x.y: the flag's value
            continue
        if arg.startswith("--") and arg[2:3] not in ("", "=", "-") and arg.split("=", 1)[0] not in HYDRA_FLAGS:
            _check_dashed(args, i, recipe)
        key = override_key(arg)
        if key is not None:
            _check_key(arg, key, recipe)

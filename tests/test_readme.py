"""The documentation's commands and option names are the ones colo_rl accepts (README.md, the topic
pages in docs/ and the measured runs in benchmarks/results/runs.md): every recipe command line and
`make ... ARGS="..."` example composes with its recipe's config and passes the start-up validation
(with the docs' own example files, written where the command expects them), and every config key
named in backticks exists in the schema. A renamed key or group fails here, not in a user's first run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from colo_rl.config import RunConfig, register_configs
from colo_rl.config.command_line import check_override_keys
from colo_rl.config.validation import FREE_KEYS, validate
from colo_rl.errors import ConfigError
from colo_rl.loggers import unavailable as logger_unavailable

ROOT = Path(__file__).resolve().parents[1]
# docs/config.md is generated from the schema itself (tests/test_config_reference.py keeps it current)
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "config.md"),
         ROOT / "benchmarks" / "results" / "runs.md"]
TEXTS = {str(p.relative_to(ROOT)): p.read_text() for p in PAGES}
README = "\n".join(TEXTS.values())  # every page, for what may be on any of them
register_configs()

# `make <target> ARGS="..."`: the recipe each target runs and the overrides the Makefile adds
MAKE_TARGETS = {"demo": ("grpo", ["trainer.mini_batches_per_step=2"]),
                "demo-tools": ("grpo", ["env=calculator", "data=arithmetic_hard"]),
                "sft": ("sft", []), "dpo": ("dpo", []), "eval": ("eval", [])}
# The README's example of a misspelled key: it must keep failing, with the message the README shows.
TYPO_EXAMPLE = "trainer.lrr=1e-5"
# `    $ python recipes/<recipe>.py <overrides>` followed by what it prints (up to the next `$` or blank
# line): the pages' examples of refused command lines.
SHOWN_ERROR = re.compile(r"^    \$ python recipes/(\w+)\.py (.*?)(?:\s+#.*)?\n((?:    (?!\$).*\n)+)", re.M)
OVERRIDE = re.compile(r"^[+~]?[a-z_][\w.]*=")
FILE_SUFFIX = re.compile(r"\.(md|py|json|jsonl|yaml|png|txt|db)$")


def readme_commands() -> list[tuple[str, str, list[str]]]:
    """(page:line, recipe, overrides) for each command line of every page, `\\` continuations joined."""
    return [(f"{name}:{number}", recipe, overrides) for name, text in TEXTS.items()
            for number, recipe, overrides in page_commands(text)]


def page_commands(text: str) -> list[tuple[int, str, list[str]]]:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        while 'ARGS="' in line and line.split('ARGS="', 1)[1].count('"') == 0 and i + 1 < len(lines):
            i += 1  # a quoted ARGS that prose wraps onto the next line
            line = line + " " + lines[i].strip()
        i += 1
        line = line.split("  #")[0]  # a trailing comment
        recipe_call = re.search(r"recipes/(\w+)\.py(.*)", line)
        make_call = re.search(r'make ([\w-]+) ARGS="([^"]*)"', line)
        if recipe_call:
            recipe, extra, args = recipe_call.group(1), [], recipe_call.group(2)
        elif make_call and make_call.group(1) in MAKE_TARGETS:
            (recipe, extra), args = MAKE_TARGETS[make_call.group(1)], make_call.group(2)
        else:
            continue
        # placeholders (`<timestamp>`, `$lr`) stand for a value; the shell's `;` ends the command
        args = re.sub(r"<[\w-]+>|\$\w+", "1", args.replace("`", " ")).split(";")[0]
        out.append((number, recipe, extra + [t for t in shlex.split(args) if OVERRIDE.match(t)]))
    return out


def config_name(recipe: str) -> str:
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    return re.search(r'@hydra\.main\([^)]*config_name="(\w+)"', source).group(1)


def test_the_config_reference_composes_each_recipes_own_config():
    from colo_rl.config.reference import RECIPE_CONFIGS
    assert RECIPE_CONFIGS == {recipe: config_name(recipe) for recipe in RECIPE_CONFIGS}


def compose_for(recipe: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=config_name(recipe), overrides=overrides)


def write_readme_examples(where: Path) -> None:
    """The files the README's commands name: its environment class (the code block under
    `# my_env.py`), the reward files of the docs' python blocks headed `# <file>.py`, and a reward
    function of the documented shape."""
    block = README.split("    # my_env.py\n", 1)[1].split("\n\n    torchrun", 1)[0]
    (where / "my_env.py").write_text("\n".join(line[4:] for line in block.splitlines()) + "\n")
    for name, code in re.findall(r"```python\n# ([\w/]+\.py)\n(.*?)```", README, re.S):  # docs/data.md's rewards
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(code)
    (where / "rewards").mkdir(exist_ok=True)
    (where / "rewards" / "my_rewards.py").write_text(
        "def score(completion: str, truth: str, **fields) -> float:\n    return float(truth in completion)\n")


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_check():
    recipes = {recipe for _, recipe, _ in COMMANDS}
    assert recipes == {"grpo", "sft", "dpo", "eval"}, recipes
    assert len(COMMANDS) >= 30, len(COMMANDS)


REFUSED = [(m.group(1), shlex.split(m.group(2)), m.group(3)) for text in TEXTS.values()
           for m in SHOWN_ERROR.finditer(text)]
ACCEPTED = [c for c in COMMANDS if (c[1], c[2]) not in [(r, o) for r, o, _ in REFUSED]]


@pytest.mark.parametrize("number,recipe,overrides", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_readme_command_is_accepted(number, recipe, overrides, tmp_path, monkeypatch):
    write_readme_examples(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths in the commands are read from the launch directory
    cfg = compose_for(recipe, overrides)
    missing = logger_unavailable(list(cfg.logger))
    if missing:  # an optional extra this environment lacks (the GPU image has no wandb or mlflow; make test's venv has
        with pytest.raises(ConfigError) as refused:  # both): refused at start-up, saying what to install
            validate(cfg, recipe, overrides)
        assert str(refused.value) == missing and "pip install" in missing
        return
    validate(cfg, recipe, overrides)


@pytest.mark.parametrize("target", MAKE_TARGETS)
def test_make_targets_run_the_recipe_and_overrides_assumed_here(target):
    makefile = (ROOT / "Makefile").read_text()
    body = re.search(rf"^{re.escape(target)}: .*\n\t(.*)$", makefile, re.M).group(1)
    recipe, extra = MAKE_TARGETS[target]
    assert body == " ".join(["$(TORCHRUN)", f"recipes/{recipe}.py", *extra, "$(ARGS)"]), body


def test_refused_command_lines_fail_as_shown():
    """Each shown refusal prints what the page shows: colo_rl's check before Hydra
    (`runtime.check_command_line`: `error: ...`), else Hydra's own composition error."""
    assert TYPO_EXAMPLE in [o for _, overrides, _ in REFUSED for o in overrides]
    assert len(REFUSED) >= 3, REFUSED
    for recipe, overrides, shown in REFUSED:
        try:
            check_override_keys(overrides, recipe)
        except ConfigError as e:
            printed = f"error: {e}"
        else:
            with pytest.raises(Exception) as err:
                compose_for(recipe, overrides)
            printed = f"{err.value}\n{err.value.__cause__}"  # what Hydra prints: the error, then its cause
        for line in shown.splitlines():
            assert line.strip() in printed, (overrides, line, printed)


def test_config_keys_named_in_the_readme_exist():
    schema = OmegaConf.structured(RunConfig)
    sections = set(schema.keys())
    missing = []
    for name, text in TEXTS.items():
        for span in re.finditer(r"`([^`\n]+)`", text):
            for token in span.group(1).split():
                key = re.match(r"^\+?([a-z_]+(?:\.[a-z_0-9]+)+)", token)
                if (not key or key.group(1).split(".")[0] not in sections or FILE_SUFFIX.search(key.group(1))
                        or key.group(1).startswith(FREE_KEYS) or TYPO_EXAMPLE.split("=")[0] in token):
                    continue
                if OmegaConf.select(schema, key.group(1), default=KeyError) is KeyError:
                    missing.append(f"{name}:{text[:span.start()].count(chr(10)) + 1}: {key.group(1)}")
    assert not missing, missing

"""docs/metrics.md lists every per-step metric: each key a recipe or library module names as a string
literal (f-string templates as their `<placeholder>` form) is on the page. The GRPO recipe test checks
the keys of a real run's rows against the same page (tests/test_grpo_recipe.py)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
GROUPS = ("reward", "reward_source", "rewards", "logps", "response", "train", "time", "throughput", "handoff",
          "mismatch", "eval", "eval_no_tools", "sampling", "env", "split", "data")
KEY = re.compile(rf"^(?:{'|'.join(GROUPS)})/[a-z0-9_@/]+$")
NOT_LOGGED = {"eval/samples"}
PASSTHROUGH = {"train/<x>", "time/<x>"}  # the evaluation's sample texts: printed and dropped before the row is written


def documented_keys() -> set[str]:
    return set(re.findall(r"`([a-z_]+/[^`\s]+)`", DOC.read_text()))


def documented(key: str, keys: set[str] | None = None) -> bool:
    """`key` is on the page, as it is or through a `<placeholder>` (reward_source/<name>)."""
    keys = documented_keys() if keys is None else keys
    if key in keys:
        return True
    return any(re.fullmatch(re.sub(r"<[^>]+>", "[^/]+", re.escape(k).replace(r"\<", "<").replace(r"\>", ">")), key)
               for k in keys if "<" in k)


def literal_keys(path: Path) -> set[str]:
    """Metric-shaped string constants in a module; f-strings with one placeholder as `<...>`."""
    tree = ast.parse(path.read_text())
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            if KEY.match(node.value) and not node.value.endswith(("/", "@")):  # a prefix (startswith) is no key
                out.add(node.value)
        elif isinstance(node, ast.JoinedStr):
            text = "".join("<x>" if isinstance(v, ast.FormattedValue) else str(v.value) for v in node.values)
            # `train/{k}` / `time/{k}` pass other code's keys through (the recipe test checks a real run's rows)
            if text.count("<x>") == 1 and KEY.match(text.replace("<x>", "x")) and text not in PASSTHROUGH:
                out.add(text)
    return out


def test_every_metric_key_in_the_code_is_documented():
    keys = documented_keys()
    sources = sorted((ROOT / "recipes").glob("*.py")) + sorted((ROOT / "colo_rl").rglob("*.py"))
    missing = {}
    for path in sources:
        for key in literal_keys(path) - NOT_LOGGED:
            if not documented(key.replace("<x>", "1"), keys):
                missing.setdefault(key, str(path.relative_to(ROOT)))
    assert not missing, f"add these to docs/metrics.md: {missing}"


def test_the_check_sees_an_undocumented_key(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('x = {"train/a_new_metric": 1.0, f"reward_source/{name}": 2.0}\n')
    found = literal_keys(module)
    assert found == {"train/a_new_metric", "reward_source/<x>"}
    assert not documented("train/a_new_metric") and documented("reward_source/math_verify")

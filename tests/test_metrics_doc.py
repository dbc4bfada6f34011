"""docs/metrics.md lists every per-step metric. Statically: each key a recipe or library module names
as a string literal (f-string templates as their `<placeholder>` form, `timer("x")` as time/x) is in the
page's key column. From real runs: the GRPO, SFT, DPO and eval recipe tests check every key of their
rows against the same column (`undocumented`)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
GROUPS = ("reward", "reward_source", "rewards", "logps", "response", "train", "time", "throughput", "handoff",
          "mismatch", "eval", "eval_no_tools", "sampling", "env", "split", "data")
KEY = re.compile(rf"^(?:{'|'.join(GROUPS)})/[a-z0-9_@/]+$")
NOT_LOGGED = {"eval/samples"}  # the evaluation's sample texts: printed and dropped before the row is written
# `train/{k}` / `time/{k}` pass other code's keys through: the recipe tests check those in real rows
PASSTHROUGH = {"train/<x>", "time/<x>"}


def documented_keys() -> set[str]:
    """The keys in the first column of the page's tables, and in its prose paragraphs (SFT, DPO, eval);
    not the verl / TRL column."""
    keys = set()
    for line in DOC.read_text().splitlines():
        text = line.split("|")[1] if line.startswith("|") else line
        keys.update(k for k in re.findall(r"`([a-z_]+/[^`\s]+)`", text) if not k.endswith(".py"))
    return keys


def undocumented(rows: list[dict]) -> list[str]:
    """The keys of metrics.jsonl rows that the page does not list."""
    keys = documented_keys()
    return sorted({k for row in rows for k in row if k != "step" and not documented(k, keys)})


def documented(key: str, keys: set[str] | None = None) -> bool:
    """`key` is on the page, as it is or through a `<placeholder>` (reward_source/<name>)."""
    keys = documented_keys() if keys is None else keys
    if key in keys:
        return True
    return any(re.fullmatch(re.sub(r"<[^>]+>", "[^/]+", re.escape(k)), key)
               for k in keys if "<" in k)


def literal_keys(path: Path) -> set[str]:
    """Metric-shaped string constants in a module; f-strings with one placeholder as `<...>`."""
    tree = ast.parse(path.read_text())
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "timer"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(f"time/{node.args[0].value}")  # Timer sections are logged as time/<name>
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            if KEY.match(node.value) and not node.value.endswith(("/", "@")):  # a prefix (startswith) is no key
                out.add(node.value)
        elif isinstance(node, ast.JoinedStr):
            text = "".join("<x>" if isinstance(v, ast.FormattedValue) else str(v.value) for v in node.values)
            if text.startswith("<x>") and text.count("<x>") == 1 and KEY.match(text[3:]):
                out.add(text[3:])  # f"{prefix}logps/chosen": the key without its prefix (eval/ twins are listed)
                continue
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
    module.write_text('x = {"train/a_new_metric": 1.0, f"reward_source/{name}": 2.0, f"{p}logps/new": 3.0}\n'
                      'with self.timer("new_phase"):\n    pass\n')
    found = literal_keys(module)
    assert found == {"train/a_new_metric", "reward_source/<x>", "logps/new", "time/new_phase"}
    assert not documented("train/a_new_metric") and documented("reward_source/math_verify")
    assert not documented("actor/pg_loss")  # verl's name in the page's last column is no colo_rl key
    assert undocumented([{"step": 1, "reward/mean": 0.5, "time/new_phase": 1.0}]) == ["time/new_phase"]

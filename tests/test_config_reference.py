"""Issue #36: each option's rules sit beside its field (schema.py `opt`), one pass applies them, and
docs/config.md is generated from them; engines are a registry whose rules sit on the engine class."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from colo_rl.checkpoint import compare_configs, config_container
from colo_rl.config import OPTIONS, RECIPES, ConfigError, RunConfig, reads, resume_rule
from colo_rl.config.options import RECIPE_NAMES, option_fields, rules_of
from colo_rl.config.reference import DOC, field_comments, groups, render
from colo_rl.rollout import ENGINES, Engine, capabilities_of
from conftest import ROOT, child_env


def test_every_option_says_which_recipes_read_it():
    """A field added without `opt(..., scope)` fails here, naming it: without a scope, a recipe that
    ignores the option would accept it silently."""
    missing = [key for key, f in option_fields(RunConfig) if rules_of(f) is None]
    assert not missing, f"schema fields without rules (use opt(default, reads(...)) in schema.py): {missing}"
    assert set(OPTIONS) == {key for key, _ in option_fields(RunConfig)}
    for key, rules in OPTIONS.items():  # every recipe either reads it or is told what to set instead
        assert set(rules.scope.reads) | set(rules.scope.instead) == set(RECIPE_NAMES), key
    assert tuple(RECIPES) == RECIPE_NAMES


def test_every_option_has_one_line_of_help():
    undocumented = [f"{prefix}{name}" for prefix, cls in groups() for name, text in field_comments(cls).items()
                    if not text and f"{prefix}{name}" in OPTIONS]
    assert not undocumented, f"give these a comment beside their field in schema.py: {undocumented}"


def test_a_scope_must_say_what_the_other_recipes_set_instead():
    assert reads("grpo", others="GRPO only").instead == {"sft": "GRPO only", "dpo": "GRPO only", "eval": "GRPO only"}
    with pytest.raises(ValueError, match=r"say what \['sft', 'dpo', 'eval'\] should set instead"):
        reads("grpo")
    with pytest.raises(ValueError, match=r"unknown recipe\(s\) \['ppo'\]"):
        reads("ppo", others="x")


def test_the_config_reference_is_current():
    """docs/config.md is what `python -m colo_rl.config.reference` writes from the schema today."""
    assert DOC.read_text() == render(), "docs/config.md is stale: run `python -m colo_rl.config.reference`"
    table_rows = re.findall(r"^\| `([\w.]+)` \|", DOC.read_text(), flags=re.M)
    assert sorted(table_rows) == sorted(OPTIONS)  # every option, once


def test_the_reference_command_checks_and_says_what_to_run(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "colo_rl.config.reference", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    from colo_rl.config import reference

    monkeypatch.setattr(reference, "DOC", tmp_path / "config.md")
    (tmp_path / "config.md").write_text("old\n")
    assert reference.main(["--check"]) == 1
    assert reference.main([]) == 0 and (tmp_path / "config.md").read_text() == render()


def test_a_row_shows_type_default_range_readers_resume_and_help():
    row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| `rollout.top_p` |"))
    assert row == ("| `rollout.top_p` | `float` | `1.0` |  | in (0, 1] (1 = no nucleus cut) | grpo, eval | warned | "
                   "Sampling: new tokens per completion (per turn with an environment), temperature, nucleus top_p. |")
    row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| `rollout.engine` |"))
    assert "`hf` \\| `sglang`" in row  # the engine registry's names


def test_the_recipe_column_shows_what_each_recipes_yaml_sets_instead():
    # conf/trainer/{grpo,sft,dpo}_cpu.yaml set their own learning rates; eval does not read trainer.lr
    from colo_rl.config.reference import recipe_values
    composed = recipe_values()
    assert composed["sft"]["trainer.lr"] != composed["grpo"]["trainer.lr"]
    row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| `trainer.lr` |"))
    cell = row.split(" | ")[3]
    assert cell == "; ".join(f"{r}: `{composed[r]['trainer.lr']!r}`" for r in ("grpo", "sft", "dpo")), cell


@pytest.mark.parametrize("key,refused,silent", [
    ("rollout.group_size", "a step's batch would no longer be the one the state was saved for", False),
    ("trainer.total_steps", None, True),
    ("algo.kl_coef", None, False),
    ("rollout.sglang_kwargs.disable_cuda_graph", None, False),  # inside a free dict: the dict's rule
    ("data.a_removed_key", "the saved data position indexes a different dataset / order", False),  # its group's
    ("colocate.a_removed_key", None, True),
])
def test_the_resume_rule_is_the_options_own(key, refused, silent):
    rule = resume_rule(key)
    assert (rule.refused, rule.silent) == (refused, silent)


def test_a_resume_is_judged_by_the_rules_beside_the_fields():
    saved = config_container(RunConfig())
    now = OmegaConf.to_container(OmegaConf.structured(RunConfig()))
    now["trainer"]["lr"], now["trainer"]["total_steps"], now["algo"]["kl_coef"] = 3e-5, 99, 0.5
    refusals, warnings = compare_configs(saved, now)
    assert refusals == ["trainer.lr: checkpoint 1e-05, now 3e-05 (the restored optimizer and scheduler state would "
                        "silently keep the old value)"]
    assert warnings == ["algo.kl_coef: checkpoint 0.0, now 0.5"]  # total_steps: silently


# ---- engines
def test_engines_are_registered_with_their_rules_on_the_class():
    assert ENGINES.names() == ["hf", "sglang"]
    hf, sglang = ENGINES.get("hf"), ENGINES.get("sglang")
    assert issubclass(hf, Engine) and issubclass(sglang, Engine)
    assert (hf.capabilities.tensor_parallel, sglang.capabilities.tensor_parallel) == (False, True)
    assert (hf.sizes_memory_at_start, sglang.sizes_memory_at_start) == (False, True)
    assert hf.capabilities.stop_strings and sglang.capabilities.stop_strings
    assert (hf.capabilities.sampling_rng, sglang.capabilities.sampling_rng) == (True, False)
    assert sglang.tp_rank_payload is not None and hf.tp_rank_payload is None
    engines = {OmegaConf.load(p).engine for p in (ROOT / "conf" / "rollout").glob("*.yaml")}
    assert engines == set(ENGINES.names())  # each engine has its YAML group


def test_capabilities_are_declared_not_probed():
    class Plain:  # has the methods but declares nothing: not used as a capability
        def rng_state(self):
            return 1

    assert not capabilities_of(Plain()).sampling_rng and not capabilities_of(None).adapters


def test_a_new_engine_is_one_registered_class(monkeypatch):
    """What adding an engine takes: an Engine subclass under @ENGINES.register. Its rules apply at once
    (the choice, the tensor-parallel refusal, the context length), with no other file touched."""
    from colo_rl.config import validate
    from colo_rl.runtime import run_context_length

    monkeypatch.setattr(ENGINES, "_entries", dict(ENGINES._entries))

    @ENGINES.register("toy")
    class ToyEngine(Engine):
        title = "Toy"

        @classmethod
        def context_length(cls, cfg, model_length):
            return 77, "the toy's own"

    cfg = RunConfig()
    cfg.rollout.engine = "toy"
    validate(cfg, "grpo")
    assert run_context_length(cfg) == (77, "the toy's own")
    cfg.rollout.tp_size = 2
    with pytest.raises(ConfigError, match=r"rollout.tp_size=2 splits SGLang's engine over GPUs; rollout.engine=toy "
                                          r"runs a whole model on every rank and would ignore it: use rollout=sglang"):
        validate(cfg, "grpo")
    cfg.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm' is not one of \['hf', 'sglang', 'toy'\]"):
        validate(cfg, "grpo")


def test_no_engine_name_is_compared_outside_the_registry():
    """`rollout.engine` is compared as a string nowhere outside colo_rl/rollout (the engines' own modules)."""
    pattern = re.compile(r"engine\s*(==|!=)|engine\s+in\s*[(\[{]|[\"'](hf|sglang)[\"']\s*(==|!=)|(==|!=)\s*[\"'](hf|sglang)"
                         r"[\"']|in\s*[(\[{][^)\]}]*[\"'](hf|sglang)[\"']")
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("colo_rl", "recipes") for p in sorted((ROOT / d).rglob("*.py"))
            if "rollout" not in p.relative_to(ROOT).parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]
    assert not hits, hits

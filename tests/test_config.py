"""Typed configs: a typo or a bad value fails at start-up, naming the key."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from colo_rl.config import ConfigError, RunConfig, register_configs, to_object, validate

from conftest import ROOT

register_configs()


def _compose(overrides, name="config"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_default_config_composes_to_the_typed_schema():
    cfg = to_object(_compose([]))
    assert cfg.model.path == "embedded" and cfg.trainer.zero_stage == 3 and cfg.rollout.engine == "hf"


@pytest.mark.parametrize("override,key", [("trainer.lrr=1", "lrr"), ("rollout.grup_size=4", "grup_size"),
                                          ("nonsense=1", "nonsense")])
def test_misspelled_override_fails_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        _compose([override])
    assert key in str(e.value) + str(e.value.__cause__)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        _compose(["trainer.lr=fast"])
    assert "lr" in str(e.value) + str(e.value.__cause__)


def test_bad_choice_fails_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm' is not one of"):
        to_object(_compose(["rollout.engine=vllm"]))
    with pytest.raises(ConfigError, match="rollout.group_size"):
        validate(to_object(_compose([])).__class__(rollout=RunConfig().rollout.__class__(group_size=0)))


def test_recipe_rejects_a_typo_before_starting_work():
    """The real command line: the error names the key and nothing heavy starts."""
    proc = subprocess.run([sys.executable, "recipes/grpo.py", "trainer.lrr=1e-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "lrr" in proc.stdout + proc.stderr
    assert "run dir" not in proc.stdout

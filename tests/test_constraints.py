"""`make install` takes the versions in .ci/constraints.txt (the ones the suite last passed with): every
package colo_rl requires, its test and logger extras and SGLang-on-CPU's list has a pin there, and the
pin satisfies what pyproject.toml asks (`[bench]` names its one package's exact version itself). A
dependency added without `make lock` fails here rather than installing an untested release."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Left to the machine: the Makefile installs torch's CPU or CUDA build, and triton / torchvision follow it.
UNPINNED = {"torch", "triton", "torchvision"}


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def required() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    sources = [("dependencies", r) for r in project["dependencies"]]
    sources += [(f"[{extra}]", r) for extra in ("dev", "wandb", "mlflow") for r in extras[extra]]
    sources += [("tests/sglang_cpu_requirements.txt", line.strip())
                for line in (ROOT / "tests" / "sglang_cpu_requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return [(where, Requirement(r)) for where, r in sources]


def test_the_constraints_pin_exact_versions_and_leave_torch_to_the_machine():
    versions = pins()
    assert len(versions) > 50
    assert not UNPINNED & versions.keys()


@pytest.mark.parametrize("where,req", [(w, r) for w, r in required() if canonicalize_name(r.name) not in UNPINNED], ids=lambda x: str(x))
def test_every_requirement_is_pinned_to_a_version_it_allows(where, req):
    version = pins().get(canonicalize_name(req.name))
    assert version is not None, f"{req.name} ({where}) has no pin in .ci/constraints.txt: run `make lock`"
    assert req.specifier.contains(version, prereleases=True), \
        f"{req.name}=={version} in .ci/constraints.txt does not satisfy {where}'s {req}: run `make lock`"

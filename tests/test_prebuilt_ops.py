"""COLO_RL_PREBUILT_OPS: a DeepSpeed op built elsewhere is loaded, not built (colo_rl/train/prebuilt_ops.py).

The real op on CPU is the FusedAdam that `make install` built into the venv's TORCH_EXTENSIONS_DIR: kept
with save_prebuilt_op into a fresh directory, then loaded in a fresh process whose own extensions directory
is empty, so any build would show there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colo_rl.train.prebuilt_ops import build_manifest, manifest_mismatch, save_prebuilt_op
from conftest import child_python_path


def test_manifest_mismatch_names_what_differs():
    m = build_manifest("2.11.0+cu130", "13.0", ["9.0"])
    assert manifest_mismatch(m, "2.11.0+cu130", "13.0", (9, 0)) is None
    assert "torch 2.11.0+cu128" in manifest_mismatch(m, "2.11.0+cu128", "13.0", (9, 0))
    assert "CUDA 12.8" in manifest_mismatch(m, "2.11.0+cu130", "12.8", (9, 0))
    assert "this device is 8.0" in manifest_mismatch(m, "2.11.0+cu130", "13.0", (8, 0))
    assert "sees none" in manifest_mismatch(m, "2.11.0+cu130", "13.0", None)  # a CUDA op on a machine without GPU
    # Hopper's arch-specific build (9.0a) runs on capability 9.0
    assert manifest_mismatch(build_manifest("2.11.0", "13.0", ["9.0a"]), "2.11.0", "13.0", (9, 0)) is None
    # a CPU op: no CUDA, no device capability
    assert manifest_mismatch(build_manifest("2.13.0+cpu", None, []), "2.13.0+cpu", None, None) is None


PROBE = """
import json, sys
import torch
from colo_rl.train.prebuilt_ops import load_prebuilt_ops
from deepspeed.ops.op_builder import FusedAdamBuilder
loaded = load_prebuilt_ops()
op = FusedAdamBuilder().load()
print(json.dumps({"loaded": loaded, "file": getattr(op, "__file__", None)}))
"""


def _built_fused_adam() -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")
    found = sorted(root.glob("fused_adam*/fused_adam.so"))
    if not found:
        pytest.skip(f"no FusedAdam built under {root} (make install builds it)")
    return found[0]


@pytest.mark.parametrize("matching", [True, False])
def test_prebuilt_fused_adam_is_loaded_not_built(tmp_path, matching):
    import torch

    if torch.version.cuda and not torch.cuda.is_available():
        pytest.skip("a CUDA build of torch without a GPU (the GPU stack on CPU): its FusedAdam is a CUDA op "
                    "that load_prebuilt_ops rightly refuses here")
    version = torch.__version__ if matching else "0.0.1"
    save_prebuilt_op("fused_adam", _built_fused_adam(), tmp_path / "ops", build_manifest(version, torch.version.cuda, []))
    assert json.loads((tmp_path / "ops" / "fused_adam.json").read_text())["torch"] == version
    env = dict(os.environ, COLO_RL_PREBUILT_OPS=str(tmp_path / "ops"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=child_python_path())
    if not matching:  # the mismatch falls back to DeepSpeed's own build: stop before it compiles for a minute
        code = PROBE.replace("op = FusedAdamBuilder().load()", "op = None")
    else:
        code = PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if matching:
        assert result["loaded"] == ["fused_adam"]
        assert result["file"] == str(tmp_path / "ops" / "fused_adam.so")
        assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))  # nothing built
    else:
        assert result["loaded"] == []
        assert "not used (built for torch 0.0.1" in out.stderr

"""TEST SUPPORT: SGLang's real engine on CPU for colo_rl's tests (tests/test_sglang_cpu*.py).

`activate()` makes this process and every process it starts (SGLang's spawned scheduler and
detokenizer, torchrun's ranks) find the test shims in tests/sglang_cpu_shims/ (torchvision's
operator schemas, a pure-torch sgl_kernel stand-in) and run SGLang's CPU engine
(SGLANG_USE_CPU_ENGINE=1). `SGLANG_KWARGS` is what rollout.sglang_kwargs needs on CPU.

These tests run in `make test` (tests/test_sglang_cpu.py) and `make test-e2e` (the recipe
and embedded-model files; CI runs both). The Makefile installs SGLang's CPU stack first: when SGLang
is missing they fail, naming the install step, rather than skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
from conftest import child_python_path, hydra_dict

SHIMS = Path(__file__).resolve().parent / "sglang_cpu_shims"
# The releases these tests know, and whether each has the weight-update session
# (Engine.begin/end_weight_update). `make test` runs 0.5.21; `make gpu-stack-test` runs the GPU
# carry's 0.5.17 (no session: its update path runs nowhere else before a GPU).
SESSION_API = {"0.5.21": True, "0.5.17": False}
SGLANG_VERSION = os.environ.get("COLO_RL_SGLANG_CPU_VERSION", "0.5.21")
HAS_SESSION = SESSION_API.get(SGLANG_VERSION, True)
# Whether the release's CPU engine runs tp_size > 1: 0.5.17's builds a PyNccl communicator on the CPU
# device for every group of more than one rank and fails ("Expected a cuda device, but got: cpu").
CPU_TENSOR_PARALLEL = {"0.5.21": True, "0.5.17": False}

# SGLang's CPU engine without SGLang's CPU kernels: torch-native attention, no CUDA graphs, no
# overlap scheduling (a second thread), a bounded KV cache (the CPU memory plan: RAM is shared).
SGLANG_KWARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                     disable_overlap_schedule=True, max_total_tokens=2048, max_running_requests=8)


def hydra_kwargs() -> str:
    """SGLANG_KWARGS as a Hydra override value."""
    return hydra_dict(SGLANG_KWARGS)


def env() -> dict[str, str]:
    """Environment additions for processes that run SGLang's CPU engine."""
    return {"PYTHONPATH": child_python_path(str(SHIMS)), "SGLANG_USE_CPU_ENGINE": "1"}


def require_sglang() -> None:
    """Fail (not skip): these tests are part of make test and CI. (A CUDA machine runs SGLang on its GPU
    instead: tests/test_gpu.py, `make gpu-check`; the Makefile installs the CPU stack only without CUDA.)"""
    import torch

    if torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine tests: this machine has CUDA (make gpu-check runs SGLang there)")
    if importlib.util.find_spec("sglang") is None:
        pytest.fail(f"SGLang {SGLANG_VERSION} is not installed in this environment: `make test` installs it "
                    "(the sglang-cpu stamp in the Makefile); by hand: make sglang-cpu", pytrace=False)
    from importlib.metadata import version

    assert version("sglang") == SGLANG_VERSION, f"these tests pin SGLang {SGLANG_VERSION}, found {version('sglang')}"


def activate(monkeypatch) -> None:
    """This process and its children: shims on the path, SGLang's CPU engine on."""
    require_sglang()
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    if str(SHIMS) not in sys.path:
        monkeypatch.syspath_prepend(str(SHIMS))
    import colo_rl_sglang_cpu_shim

    colo_rl_sglang_cpu_shim.install()


@contextlib.contextmanager
def colocated(make_cfg, tokenizer, work: Path, total_steps: int = 8, dtype=None):
    """The colocated set (ZeRO-3 actor, SGLang's CPU engine, switcher) for one test module:
    shims and CPU engine on, a world of one kept for the session (a process group cannot be
    re-created here), the engine shut down and the start method SGLang forced restored after.
    `make_cfg()` builds the RunConfig once the environment is set; rollout.sglang_kwargs is filled in."""
    import torch

    from colo_rl import dist
    from colo_rl.colocate.setup import build_colocated

    method = multiprocessing.get_start_method(allow_none=True)
    with pytest.MonkeyPatch.context() as mp:
        activate(mp)
        dist.init()
        cfg = make_cfg()
        cfg.rollout.sglang_kwargs = dict(SGLANG_KWARGS)
        built = build_colocated(cfg, tokenizer, dtype or torch.float32, run_dir=work, total_steps=total_steps,
                                grad_accum=1)
        built.cfg, built.work, built.pad = cfg, work, tokenizer.pad_token_id
        try:
            yield built
        finally:
            if built.engine is not None:
                built.engine.shutdown()
            multiprocessing.set_start_method(method, force=True)

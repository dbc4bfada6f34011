"""TEST SUPPORT ONLY (colo_rl's SGLang-on-CPU tests): never on a user's path.

SGLang 0.5.21 runs on a CPU-only machine with plain-torch kernels (SGLANG_USE_CPU_ENGINE=1,
attention_backend=torch_native), but two of its imports assume a CUDA machine:

1. `torchvision` (imported unconditionally by sglang.srt.configs, via multimodal utils): the PyPI
   wheel is a CUDA build whose `_C.so` cannot load here, and its `_meta_registrations` then fail
   with "operator torchvision::nms does not exist". `install()` defines the schemas of the two
   operators it registers fake kernels for (`nms`, `qnms`) right before torchvision first loads, so
   the import succeeds; calling those operators still fails (nothing in a text model calls them).
2. `sgl_kernel`: the PyPI package is CUDA-only. The sibling `sgl_kernel/` package is a pure-torch
   stand-in for the one function the CPU path calls.

Activated by tests/sglang_cpu_shims/ on PYTHONPATH (its sitecustomize.py calls install(), so
SGLang's spawned scheduler / detokenizer processes get it too) or by calling install() directly.
`make test`'s CPU venv arms the torchvision part in every process (a .pth written by the Makefile's
sglang-cpu stamp): once SGLang's CUDA-built torchvision is installed there, transformers cannot
import its models without it. That venv is the tests'; on a CUDA machine none of this is installed.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = []  # keeps the torch.library fragment (and its definitions) alive


def define_torchvision_schemas() -> list[str]:
    """Define torchvision::nms / qnms unless they exist (a working torchvision already loaded).
    Returns the names defined here."""
    import torch

    defined = []
    for name, schema in SCHEMAS.items():
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue
        except RuntimeError:
            pass
        if not _LIBRARY:
            _LIBRARY.append(torch.library.Library("torchvision", "FRAGMENT"))
        _LIBRARY[0].define(schema)
        defined.append(name)
    return defined


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs define_torchvision_schemas() when `torchvision` is first imported, then steps aside
    (returns no spec: the normal finders load torchvision)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_torchvision_schemas()
        return None


def install() -> None:
    """Idempotent: arm the torchvision hook (or define the schemas now if torchvision is loaded)."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())

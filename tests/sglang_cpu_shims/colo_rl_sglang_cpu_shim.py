"""TEST SUPPORT ONLY (colo_rl's SGLang-on-CPU tests): never on a user's path.

SGLang 0.5.21 runs on a CPU-only machine with plain-torch kernels (SGLANG_USE_CPU_ENGINE=1,
attention_backend=torch_native), but two of its imports assume a CUDA machine:

1. `torchvision` (imported unconditionally by sglang.srt.configs, via multimodal utils): the PyPI
   wheel is a CUDA build whose `_C.so` cannot load here, and its `_meta_registrations` then fail
   with "operator torchvision::nms does not exist". `install()` defines the schemas of the two
   operators it registers fake kernels for (`nms`, `qnms`) right before torchvision first loads, so
   the import succeeds; calling those operators still fails (nothing in a text model calls them).
   With a CUDA build of torch (`make gpu-stack-test`: the GPU image's) torchvision loads its own
   library, and nothing is defined.
2. `sgl_kernel`: the PyPI package is CUDA-only. The sibling `sgl_kernel/` package is a pure-torch
   stand-in for the one function the CPU path calls.
3. LoRA (`sglang.srt.lora`) builds host tensors with `pin_memory=True`, which a torch without an
   accelerator refuses. `install_lora_pin_memory()` (armed by sitecustomize.py, so in SGLang's
   scheduler, and in every process of `make test`'s venv: its .pth puts this folder on sys.path,
   and Python then imports the sitecustomize.py found there) drops the flag, once sglang.srt.lora is
   first imported: page-locking is a transfer speed-up, and there is no device to transfer to. The
   patched factories keep working under `with torch.device(...)` (tests/test_sglang_cpu_shim.py).

Activated by tests/sglang_cpu_shims/ on PYTHONPATH (its sitecustomize.py calls install(), so
SGLang's spawned scheduler / detokenizer processes get it too) or by calling install() directly.
`make test`'s CPU venv arms the torchvision part in every process (a .pth written by the Makefile's
sglang-cpu stamp): once SGLang's CUDA-built torchvision is installed there, transformers cannot
import its models without it. That venv is the tests'; on a CUDA machine none of this is installed.
"""

from __future__ import annotations

import functools
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
    if torch.version.cuda is not None:  # a CUDA torch loads the CUDA torchvision's own library (and
        return defined                  # aborts on a schema defined twice): nothing to stand in for
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


class _BeforeImport(importlib.abc.MetaPathFinder):
    """Runs `action()` when module `name` is first imported, then steps aside (returns no spec:
    the normal finders load the module)."""

    def __init__(self, name, action):
        self.name, self.action = name, action

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            self.action()
        return None


def _arm(name, action) -> None:
    """Idempotent: `action` before `name` is first imported (nothing if it is loaded already)."""
    if name not in sys.modules and not any(isinstance(f, _BeforeImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeImport(name, action))


def install() -> None:
    """Idempotent: arm the torchvision hook (nothing if torchvision is loaded: too late, or not needed)."""
    _arm("torchvision", define_torchvision_schemas)


PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor")


def _without_pin_memory(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapped


def drop_pin_memory() -> bool:
    """On a torch without an accelerator only: factories ignore pin_memory, Tensor.pin_memory()
    returns the tensor. Returns whether it patched."""
    import torch

    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_colo_rl_shim", False):
        return False
    # torch's device context (`with torch.device("meta")`, which transformers' from_pretrained builds
    # every model under) recognises factories by identity, in a set it caches on first use. Filled
    # after this patch, it would hold the wrappers, and the real factories they call would ignore the
    # context: models then build on the host, the module flags that skip initialisation are set, and
    # non-persistent buffers (the rotary inv_freq) are left as uninitialised memory. Fill it now.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in PINNING_FACTORIES:
        setattr(torch, name, _without_pin_memory(getattr(torch, name)))

    def pin_memory(self, *args, **kwargs):
        return self

    pin_memory._colo_rl_shim = True
    torch.Tensor.pin_memory = pin_memory
    return True


def install_lora_pin_memory() -> None:
    """Idempotent: drop_pin_memory() when sglang.srt.lora is first imported (torch is loaded by then)."""
    _arm("sglang.srt.lora", drop_pin_memory)

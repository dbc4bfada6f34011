"""The CUDA toolkit for JIT builds (colo_rl/cuda_toolkit.py), two traps seen with nvcc 13.0 here
(`make gpu-compile-check`): an `nvcc` wrapper script outside the toolkit (/usr/local/bin/nvcc ->
exec /usr/local/cuda-13.0/bin/nvcc) made torch, DeepSpeed and tvm-ffi build against /usr/local and
fail to link (`cannot find -lcudart`); a compiler-only toolkit lacks the cuSPARSE/cuBLAS headers
torch's ATen/cuda includes (`cusparse.h: No such file`), which NVIDIA's wheels next to torch have.
Fake directory trees; the last test has torch's and DeepSpeed's own builders read the result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from colo_rl import cuda_toolkit
from colo_rl.cuda_toolkit import ATEN_LIBRARY_HEADERS, build_env_changes, prepare_jit_builds

NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"


def make_toolkit(root: Path, library_headers: bool = True) -> Path:
    files = ["bin/nvcc", "include/cuda_runtime.h", "lib/libcudart.so"]
    files += [f"include/{h}" for h in ATEN_LIBRARY_HEADERS] if library_headers else []
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(NVCC if rel == "bin/nvcc" else "")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "lib64").symlink_to("lib")  # the wheels' layout: lib64 -> lib
    return root


def make_wheel_headers(site: Path) -> Path:
    """NVIDIA's CUDA 13 wheels: every library's headers in nvidia/cu13/include."""
    inc = site / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    for h in ATEN_LIBRARY_HEADERS + ("cuda_runtime.h",):
        (inc / h).write_text("")
    return site / "nvidia"


def make_wrapper(bin_dir: Path, toolkit: Path) -> Path:
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    nvcc.chmod(0o755)
    return nvcc


def test_a_wrapper_outside_the_toolkit_gives_the_real_toolkit(tmp_path):
    real = make_toolkit(tmp_path / "cuda-13.0")
    wrapper = make_wrapper(tmp_path / "usr_local" / "bin", real)
    # the builders' guess is the wrapper's grandparent, tmp/usr_local: no headers, no lib64/libcudart.so
    changes = build_env_changes({}, str(wrapper), [str(tmp_path / "missing"), str(real)], [])
    assert changes == {"CUDA_HOME": str(real)}


def test_a_compiler_only_toolkit_gets_the_wheels_library_headers_after_the_users(tmp_path):
    real = make_toolkit(tmp_path / "cuda-13.0", library_headers=False)
    roots = [str(make_wheel_headers(tmp_path / "site"))]
    inc = str(tmp_path / "site" / "nvidia" / "cu13" / "include")
    changes = build_env_changes({"CPLUS_INCLUDE_PATH": "/mine"}, str(real / "bin" / "nvcc"), [], roots)
    assert changes == {"CPLUS_INCLUDE_PATH": f"/mine:{inc}"}  # searched last: it only fills the gap
    assert build_env_changes({"CPLUS_INCLUDE_PATH": f"/mine:{inc}"}, str(real / "bin" / "nvcc"), [], roots) == {}
    full = make_toolkit(tmp_path / "full")
    assert build_env_changes({}, str(full / "bin" / "nvcc"), [], roots) == {}  # a full toolkit: nothing added


def test_nccls_header_comes_from_its_wheel_unless_the_system_has_it(tmp_path):
    """torch's c10d NCCLUtils.hpp includes nccl.h (DeepCompile's `dc` op): no toolkit ships it, the
    nvidia-nccl wheel beside torch does; a distribution's libnccl-dev in a system include dir wins."""
    full = make_toolkit(tmp_path / "full")
    nccl = tmp_path / "site" / "nvidia" / "nccl" / "include"
    nccl.mkdir(parents=True)
    (nccl / "nccl.h").write_text("")
    roots = [str(tmp_path / "site" / "nvidia")]
    system = tmp_path / "usr_include"
    system.mkdir()
    nvcc = str(full / "bin" / "nvcc")
    assert build_env_changes({}, nvcc, [], roots, system_includes=[str(system)]) == {"CPLUS_INCLUDE_PATH": str(nccl)}
    (system / "nccl.h").write_text("")
    assert build_env_changes({}, nvcc, [], roots, system_includes=[str(system)]) == {}


@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_the_users_variable_stands(tmp_path, var):
    real = make_toolkit(tmp_path / "cuda")
    wrapper = make_wrapper(tmp_path / "bin", real)
    assert build_env_changes({var: str(real)}, str(wrapper), [str(tmp_path / "other")], []) == {}


def test_a_working_guess_is_left_alone_and_no_toolkit_changes_nothing(tmp_path):
    real = make_toolkit(tmp_path / "cuda")
    assert build_env_changes({}, str(real / "bin" / "nvcc"), [str(tmp_path / "other")], []) == {}
    wrapper = make_wrapper(tmp_path / "bin", real)
    assert build_env_changes({}, str(wrapper), [str(tmp_path / "none")], []) == {}  # the build's own error follows


def test_versioned_toolkits_are_tried_newest_first(monkeypatch):
    found = ["/usr/local/cuda-12.9", "/usr/local/cuda-13.0", "/usr/local/cuda-12.10"]
    monkeypatch.setattr(cuda_toolkit.glob, "glob", lambda pattern: list(found))
    assert cuda_toolkit.default_candidates() == ["/usr/local/cuda", "/usr/local/cuda-13.0", "/usr/local/cuda-12.10",
                                                 "/usr/local/cuda-12.9"]


def test_prepare_jit_builds_sets_them_and_torch_and_deepspeed_build_with_them(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder.builder import installed_cuda_version

    real = make_toolkit(tmp_path / "cuda-13.0", library_headers=False)
    roots = [str(make_wheel_headers(tmp_path / "site"))]
    wrapper = make_wrapper(tmp_path / "usr_local" / "bin", real)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    for var in ("CUDA_HOME", "CUDA_PATH", "CPLUS_INCLUDE_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build of torch (CI's is a CPU build)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "usr_local"))  # torch's guess at import

    changes = prepare_jit_builds(candidates=[str(real)], nvidia_roots=roots)
    assert changes == {"CUDA_HOME": str(real), "CPLUS_INCLUDE_PATH": str(tmp_path / "site/nvidia/cu13/include")}
    assert {k: os.environ[k] for k in changes} == changes
    # what torch's builder (DeepSpeed's FusedAdam) compiles and links with: the toolkit's, not /usr/local's
    assert cpp_extension.CUDA_HOME == str(real)
    assert str(real / "lib64") in cpp_extension.library_paths(device_type="cuda")
    assert str(real / "include") in cpp_extension.include_paths(device_type="cuda")
    assert installed_cuda_version() == (13, 0)  # DeepSpeed's version check runs the toolkit's nvcc
    assert prepare_jit_builds(candidates=[str(real)], nvidia_roots=roots) == {}  # idempotent
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("CUDA_HOME")
    assert prepare_jit_builds(candidates=[str(real)], nvidia_roots=roots) == {}  # a CPU build of torch: no builds


@pytest.mark.parametrize("value,fixed", [
    ("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("9.0 9.0a 10.0f", "9.0;10.0"),
    ("9.0", None), ("8.0;8.6+PTX", None), ("", None), (None, None),
])
def test_deepspeed_gets_the_arch_list_without_suffixes(value, fixed):
    assert cuda_toolkit.deepspeed_arch_list(value) == fixed


def test_deepspeed_builds_fused_adam_under_an_arch_suffixed_list_and_the_users_list_comes_back(monkeypatch):
    # The H100 image's TORCH_CUDA_ARCH_LIST=9.0a: DeepSpeed's own FusedAdam builder, in the JIT mode its
    # load() uses, fails to parse it ("invalid literal for int() with base 10: '0a'"), and parses
    # what arch_list_for_deepspeed gives it (compute_capability_args needs no GPU with a list set).
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder (not the accelerator's)

    def arch_args():
        builder = FusedAdamBuilder()
        builder.jit_mode = True
        return builder.compute_capability_args()

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        arch_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with cuda_toolkit.arch_list_for_deepspeed() as seen:
        assert seen == "9.0"
        arch_args()  # parses; DeepSpeed then sets the list torch builds with
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"

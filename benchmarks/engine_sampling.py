"""Do the engines draw from the distribution the trainer computes? Same weights (the embedded
model) in SGLang's real CPU engine and colo_rl's HF engine, per precision: many samples of the same
chat prompts at the demo's temperature, then, under the trainer's distribution at that temperature,
the mean over the drawn tokens of (-log p(token) - H(p)). For tokens drawn from p each term has mean
0 given the tokens before it, so the mean is 0 within its standard error; a sampler that draws from
another distribution (another temperature, a hidden top-k / top-p, probabilities rounded in bf16)
shows as a gap. Tokens the HF engine draws at temperature 1 are the positive control.

    python benchmarks/engine_sampling.py                      # fp32 and bf16, 4 prompts x 32 samples x 24 tokens
    python benchmarks/engine_sampling.py --dtypes bf16 --n 16

Each precision runs in its own process (one process group per process). Results:
results/engine_sampling-<device>-<date>.json / .md. The test of the same property (fp32, fewer
samples): tests/test_sglang_cpu_embedded.py::test_both_engines_draw_from_the_distribution_the_trainer_computes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks import common  # noqa: E402
from colo_rl.child_env import child_python_path  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def measure(dtype: str, n: int, max_new_tokens: int, temperature: float) -> dict:
    """One precision, in this process: both engines' gaps and the positive control."""
    import torch

    import sglang_cpu  # test support: SGLang's CPU engine
    from colo_rl.config import ModelConfig, RunConfig
    from colo_rl.models import load_tokenizer
    from colo_rl.rollout.base import SamplingParams
    from test_sglang_cpu import hf_engine_on_trainer_weights
    from test_sglang_cpu_embedded import chat_prompts, surprise_gap

    def make_cfg():
        cfg = RunConfig()
        cfg.model = ModelConfig(path="embedded", dtype=dtype, random_init=False)
        cfg.rollout.engine = "sglang"
        cfg.trainer.zero_stage = 3
        return cfg

    tokenizer = load_tokenizer("embedded")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n)
    with tempfile.TemporaryDirectory() as work, \
            sglang_cpu.colocated(make_cfg, tokenizer, Path(work), total_steps=2, dtype=getattr(torch, DTYPES[dtype])) as colo:
        batch = chat_prompts(tokenizer)
        with colo.switch.generation():
            sgl = colo.engine.generate(batch, params)
        with colo.switch.update():
            hf = hf_engine_on_trainer_weights(colo)  # the HF engine in fp32 on the same (gathered) weights
            hf.generator.manual_seed(0)
            out = {"sglang": surprise_gap(colo, sgl, temperature),
                   "hf": surprise_gap(colo, hf.generate(batch, params), temperature),
                   "hf_drawn_at_t1": surprise_gap(colo, hf.generate(batch, SamplingParams(
                       max_new_tokens=max_new_tokens, temperature=1.0, n=n)), temperature)}
    return {k: {"gap": g, "stderr": se, "tokens": t} for k, (g, se, t) in out.items()}


def table(result: dict) -> str:
    lines = [f"# {common.TITLES['engine_sampling']}", "",
             f"The embedded model's weights in both engines; {len(result['prompts'])} chat prompts x {result['n']} samples x "
             f"<= {result['max_new_tokens']} tokens at temperature {result['temperature']}. Gap: the mean over the drawn "
             "tokens of -log p(token) - H(p) under the trainer's distribution at that temperature (0 for a sampler "
             "that draws from it; the last row draws at temperature 1, the control). The HF engine runs in fp32 on "
             "the trainer's gathered weights in both precisions; SGLang runs in the precision of the row.", "",
             "| precision | sampler | gap | standard error | gap / s.e. | tokens |", "|---|---|---|---|---|---|"]
    for dtype, rows in result["by_dtype"].items():
        for name, r in rows.items():
            lines.append(f"| {dtype} | {name} | {r['gap']:+.4f} | {r['stderr']:.4f} | {r['gap'] / r['stderr']:+.1f} | "
                         f"{r['tokens']} |")
    return "\n".join(lines + ([""] + [result["note"]] if result.get("note") else [])) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--n", type=int, default=32, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.8, help="the demo's")
    p.add_argument("--one", choices=list(DTYPES), help=argparse.SUPPRESS)  # a child: one precision
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.one:
        args.json.write_text(json.dumps(measure(args.one, args.n, args.max_new_tokens, args.temperature)))
        return 0
    by_dtype = {}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        with tempfile.NamedTemporaryFile(suffix=".json") as fh:
            cmd = [sys.executable, __file__, "--one", dtype, "--json", fh.name, "--n", str(args.n),
                   "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature)]
            subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": child_python_path()})
            by_dtype[dtype] = json.loads(Path(fh.name).read_text())
    from test_sglang_cpu_embedded import QUESTIONS

    result = {"by_dtype": by_dtype, "prompts": QUESTIONS, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "note": args.note}
    common.publish("engine_sampling", result, table(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

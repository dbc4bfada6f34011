"""What several workers build the same way: a recipe (the GRPO recipe class) loaded from its
file, a scripted padded batch, rollout and SFT / DPO data, and a CPU stand-in for device memory that
counts host reads (`DeviceTensor`). Workers run as scripts (torchrun puts this folder first on
sys.path), so they import it as `worker_support`; tests as `workers.worker_support`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from colo_rl import dist
from colo_rl.samples import Completion, Rollout, groups_of
from colo_rl.train.batch import TokenBatch, build_batch

ROOT = Path(__file__).resolve().parents[2]


def load_recipe_module(name: str):
    """recipes/<name>.py as a module (a recipe is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location(f"{name}_recipe_under_test", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe():
    """recipes/grpo.py's GRPORecipe."""
    return load_recipe_module("grpo").GRPORecipe


def scripted_batch(step: int) -> TokenBatch:
    """4 random prompts of 6 tokens and responses of 5, different per step and rank."""
    g = torch.Generator().manual_seed(100 * step + dist.rank())
    prompts = torch.randint(3, 400, (4, 6), generator=g).tolist()
    responses = torch.randint(3, 400, (4, 5), generator=g).tolist()
    return build_batch(prompts, responses, pad_id=0)


def scripted_rollout(groups: list[tuple[list[int], list[list[int]]]], rewards: list[float], logprob: float) -> Rollout:
    """A rollout of (prompt, responses) groups, every response token sampled at `logprob`."""
    completions = [Completion(prompt, r, [logprob] * len(r), "stop") for prompt, rs in groups for r in rs]
    n, out = len(completions), Rollout()
    out.keep(groups_of([f"problem {j}" for j in range(len(groups))], len(groups[0][1]), {}, completions=completions,
                       rewards=rewards, correct=[False] * n, lenient=[False] * n, formatted=[False] * n, texts=[""] * n))
    return out


def scripted_offline_data(seed: int, ref_slots: int = 4) -> tuple[list, list, tuple[torch.Tensor, torch.Tensor]]:
    """4 SFT examples (prompts of 4-7 random tokens, completions of 3-6, all trained), 4 preference
    pairs (4-token prompts, chosen of 2-5 tokens, rejected of 3) and cached reference log-probs
    (chosen, rejected) for `ref_slots` pair indices, drawn from `seed`."""
    from colo_rl.data.preference import PreferencePair
    from colo_rl.data.sft import SFTExample

    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()  # noqa: E731
    examples = [SFTExample(f"e{i}", ids(4 + i), ids(3 + i), [1] * (3 + i)) for i in range(4)]
    pairs = [PreferencePair(f"p{i}", ids(4), ids(2 + i), [1] * (2 + i), ids(3), [1] * 3) for i in range(4)]
    return examples, pairs, (-torch.rand(ref_slots, generator=g), -torch.rand(ref_slots, generator=g))


# ---------------------------------------------------------------------------------------- host reads
READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy"}


def tensors_in(values) -> list[torch.Tensor]:
    """The tensors among an operation's arguments (in lists and tuples too)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += tensors_in(v)
    return out


def list_index(index) -> bool:
    """Is a Python list part of this index (t[[1, 2]], t[rows, :n])?"""
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


class DeviceTensor(torch.Tensor):
    """A tensor standing for device memory: every host read of it is counted, and so is every
    operation mixing it with a host tensor of more than one element or indexing it with a Python
    list (a device mismatch error on a GPU, or a hidden blocking copy where torch moves the host
    operand itself)."""

    reads: list[str] = []
    mixed: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # .to(device): on the CPU every "device" is the host, so only an explicit "cpu" string counts
        to_host = name == "to" and any(isinstance(a, str) and a == "cpu" for a in (*args[1:], kwargs.get("device")))
        if name in READS or to_host:
            cls.reads.append(name)
        operands = tensors_in([*args, *kwargs.values()])
        touches_device = any(isinstance(t, DeviceTensor) for t in operands)
        if touches_device and any(not isinstance(t, DeviceTensor) and t.dim() > 0 for t in operands):
            cls.mixed.append(name)
        elif touches_device and name in ("__getitem__", "__setitem__") and list_index(args[1]):
            cls.mixed.append(name + " by a list")  # the index is copied to the device, blocking
        out = super().__torch_function__(func, types_, args, kwargs)
        # what came to the host is a host tensor: reading it again (cpu().tolist()) is no second sync
        return out.as_subclass(torch.Tensor) if name == "cpu" and isinstance(out, DeviceTensor) else out


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t if isinstance(t, DeviceTensor) else t.as_subclass(DeviceTensor)


def plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, DeviceTensor) else t

"""Run under torchrun (2 gloo ranks): LoRA on the real colocated set (DeepSpeed ZeRO-3, HF engine).

Writes a JSON report per rank that tests/test_lora_dist.py asserts on:
- the optimizer holds only adapter parameters; the reference is the actor's base (no second model);
- the first handoff sends base + adapters, later ones only the adapters, and after each the engine's
  log-probs of a fixed sequence equal the trainer's;
- a ZeRO-3 step changes adapter parameters only;
- the reference's log-probs equal a plain (unwrapped) base model's;
- export: the merged model loads with AutoModelForCausalLM, the adapter with PEFT, and both give the
  trainer's log-probs;
- checkpoint: it holds the adapters and a fingerprint of the base, not the base; a fresh actor loads
  it back to the same parameters; one whose base differs (on rank 1 only) is refused on both ranks.
Argument 3: the handoff mode override (auto | merged).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from colo_rl import algos, dist, process_exit
from colo_rl.checkpoint import export_hf
from colo_rl.colocate.setup import build_colocated
from colo_rl.config import AlgoConfig, LoraConfig, ModelConfig, RunConfig, TrainerConfig
from colo_rl.errors import CheckpointError
from colo_rl.lora import FROZEN_BASE_KEY, is_adapter, local_part
from colo_rl.models import load_model, load_tokenizer
from colo_rl.rollout.base import SamplingParams
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.adapters import BaseReference
from colo_rl.train.batch import build_batch

TINY = dict(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")


def teacher_forced(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, -batch.response_len - 1:-1]
    return algos.logprobs_from_logits(logits, batch.response_ids)


def all_params_on_rank0(actor):
    """Every parameter (base and adapters) under the wrapped model's names, on rank 0."""
    names = [n for n, _ in actor.named_parameter_sizes()]
    with actor.gathered(names) as tensors:
        return {n: t.detach().clone() for n, t in tensors} if dist.is_rank0() else None


def checkpoint_report(cfg, actor, directory: Path, saved_params) -> dict:
    """Save the trained actor; load it into a fresh actor and into one whose base differs on rank 1."""
    actor.save_checkpoint(str(directory), "ds")
    files = sorted((directory / "ds").glob(f"*rank_{dist.rank()}_*model_states.pt"))
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    out = {"ckpt_frozen_fragments": state.get("frozen_param_fragments") is not None,
           "ckpt_has_fingerprint": FROZEN_BASE_KEY in state,
           "ckpt_bytes": sum(f.stat().st_size for f in (directory / "ds").iterdir() if f.is_file()),
           "base_bytes": sum(p.ds_numel * 4 for n, p in actor.module.named_parameters() if not is_adapter(n))}
    fresh = DeepSpeedActor(cfg, torch.float32, total_steps=4)
    fresh.load_checkpoint(str(directory), "ds")
    loaded = all_params_on_rank0(fresh)
    if dist.is_rank0():
        out["loaded_equal"] = loaded.keys() == saved_params.keys() and all(
            torch.equal(loaded[n], saved_params[n]) for n in loaded)
    other = DeepSpeedActor(cfg, torch.float32, total_steps=4)
    if dist.rank() == 1:  # another base on one rank only: every rank must still refuse
        frozen = [p for n, p in other.module.named_parameters() if not is_adapter(n) and local_part(p).numel()]
        with torch.no_grad():
            local_part(frozen[0])[0] += 1.0
    try:
        other.load_checkpoint(str(directory), "ds")
        out["changed_base_error"] = None
    except CheckpointError as e:
        out["changed_base_error"] = str(e)
    return out


def main(out_path: str, run_dir: str, handoff: str) -> None:
    dist.init()
    cfg = RunConfig(model=ModelConfig(**TINY, lora=LoraConfig(rank=4, alpha=8.0, handoff=handoff)),
                    trainer=TrainerConfig(zero_stage=3, lr=5e-2, micro_batch_size=4),
                    algo=AlgoConfig(kl_coef=0.1))
    tok = load_tokenizer("embedded")
    run = Path(run_dir)
    colo = build_colocated(cfg, tok, torch.float32, run, total_steps=4, grad_accum=1)
    actor = colo.actor
    report: dict = {"rank": dist.rank(), "ref_is_base": isinstance(colo.ref, BaseReference)}
    trainable = [n for n, p in actor.module.named_parameters() if p.requires_grad]
    report["trainable_all_adapters"] = bool(trainable) and all(is_adapter(n) for n in trainable)
    opt_numel = sum(t.numel() for t in actor.optimizer.fp32_partitioned_groups_flat)
    adapter_numel = sum(p.ds_numel for n, p in actor.module.named_parameters() if is_adapter(n))
    total_numel = sum(p.ds_numel for p in actor.module.parameters())
    frozen_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                       for n, p in actor.module.named_parameters() if not is_adapter(n))
    report.update(optimizer_numel_this_rank=opt_numel, adapter_numel=adapter_numel, total_numel=total_numel,
                  frozen_partition_bytes_this_rank=frozen_bytes, state_bytes=actor.state_bytes())
    prompt = tok("What is 12 + 30?")["input_ids"]

    with colo.switch.generation():
        out = colo.engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0))
        response = out[0].token_ids
        batch = build_batch([prompt], [response], tok.pad_token_id)
        engine_lp0 = teacher_forced(colo.engine.model, batch)
    before = all_params_on_rank0(actor)
    with colo.switch.update():
        trainer_lp0, _ = actor.response_logprobs(batch, grad=False)
        ref_lp, _ = colo.ref.response_logprobs(batch)
        lp, _ = actor.response_logprobs(batch)
        loss, _ = algos.policy_loss(lp, lp.detach(), torch.tensor([1.0]), batch.response_mask,
                                    num_tokens=float(batch.response_mask.sum()) * dist.world_size())
        actor.backward(loss, last_micro_batch=True)
        report["step"] = actor.step()
    after = all_params_on_rank0(actor)
    with colo.switch.generation():
        engine_lp1 = teacher_forced(colo.engine.model, batch)
    with colo.switch.update():
        trainer_lp1, _ = actor.response_logprobs(batch, grad=False)
        ref_lp1, _ = colo.ref.response_logprobs(batch)
    base = load_model(cfg.model, torch.float32, seed=cfg.trainer.seed)  # the plain starting model
    plain_lp = teacher_forced(base, batch)
    report.update(
        engine_vs_trainer_before=float((engine_lp0 - trainer_lp0).abs().max()),
        engine_vs_trainer_after=float((engine_lp1 - trainer_lp1).abs().max()),
        engine_change=float((engine_lp1 - engine_lp0).abs().max()),
        ref_vs_plain_base=float((ref_lp - plain_lp).abs().max()),
        ref_after_step_vs_plain_base=float((ref_lp1 - plain_lp).abs().max()),
        policy_vs_base_after_step=float((trainer_lp1 - plain_lp).abs().max()))
    if dist.is_rank0():
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        report["changed"] = changed
        report["num_params"] = len(before)
    with colo.switch.update():
        export_hf(actor, tok, run / "export")
    if dist.is_rank0():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)
        report["merged_vs_trainer"] = float((teacher_forced(merged, batch) - trainer_lp1).abs().max())
        peft = PeftModel.from_pretrained(load_model(cfg.model, torch.float32, seed=cfg.trainer.seed),
                                         run / "export" / "adapter")
        report["peft_vs_trainer"] = float((teacher_forced(peft, batch) - trainer_lp1).abs().max())
    report["ledger"] = colo.ledger.records
    report.update(checkpoint_report(cfg, actor, run / "ckpt", after))
    Path(f"{out_path}.rank{dist.rank()}.json").write_text(json.dumps(report, default=str))
    dist.cleanup()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1], sys.argv[2], sys.argv[3]))

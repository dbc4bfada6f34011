"""Run under torchrun (2 gloo ranks): the colocated protocol with real DeepSpeed ZeRO-3.

Writes a JSON report that tests/test_colocated_dist.py asserts on:
- after the handoff the engine's weights equal the trainer's gathered weights, and the engine's
  log-probs of a fixed sequence equal the trainer's;
- a ZeRO-3 step changes the weights, and the next generation phase uses the new ones;
- the handoff writes no file and pickles nothing;
- generating in the update phase is refused;
- every transition left a ledger record.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch

from colo_rl import algos, dist, process_exit
from colo_rl.colocate.setup import build_colocated
from colo_rl.config import ModelConfig, RunConfig, TrainerConfig
from colo_rl.models import load_tokenizer
from colo_rl.phase import PhaseError
from colo_rl.rollout.base import SamplingParams
from colo_rl.train.batch import build_batch


def fixed_sequence_logprobs(colo, tok, prompt, response):
    """Engine: log-probs from a teacher-forced forward of the engine's model; trainer: the actor's."""
    batch = build_batch([prompt], [response], tok.pad_token_id)
    with torch.no_grad():
        logits = colo.engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   position_ids=batch.position_ids).logits[:, -batch.response_len - 1:-1]
    engine_lp = algos.logprobs_from_logits(logits, batch.response_ids)
    return batch, engine_lp


def main(out_path: str, run_dir: str) -> None:
    dist.init()
    cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"),
                    trainer=TrainerConfig(zero_stage=3, lr=1e-2, micro_batch_size=4))
    tok = load_tokenizer("embedded")
    run = Path(run_dir)
    colo = build_colocated(cfg, tok, torch.float32, run, total_steps=4, grad_accum=1)
    report: dict = {"rank": dist.rank(), "world": dist.world_size()}
    prompt = tok("What is 12 + 30?")["input_ids"]

    # --- generation phase 1: handoff, then compare weights and log-probs with the trainer
    forbidden = []
    real_dumps, real_save = pickle.dumps, torch.save
    pickle.dumps = lambda *a, **k: forbidden.append("pickle.dumps") or real_dumps(*a, **k)
    torch.save = lambda *a, **k: forbidden.append("torch.save") or real_save(*a, **k)
    files_before = set(p for p in run.rglob("*") if p.name != "ledger.jsonl")
    with colo.switch.generation():
        pickle.dumps, torch.save = real_dumps, real_save
        report["handoff_forbidden_calls"] = forbidden
        report["handoff_new_files"] = [str(p) for p in set(run.rglob("*")) - files_before if p.name != "ledger.jsonl"]
        engine_w0 = {n: p.detach().clone() for n, p in colo.engine.model.named_parameters()}
        out = colo.engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0))
        response = out[0].token_ids
        batch, engine_lp = fixed_sequence_logprobs(colo, tok, prompt, response)
    state0 = colo.actor.full_state_dict_on_rank0()

    with colo.switch.update():
        try:
            colo.engine.generate([prompt], SamplingParams(max_new_tokens=2))
            report["generate_in_update"] = "allowed"
        except PhaseError as e:
            report["generate_in_update"] = str(e)
        trainer_lp, _ = colo.actor.response_logprobs(batch, grad=False)
        report["engine_vs_trainer_max_abs"] = float((engine_lp - trainer_lp).abs().max())
        report["sampling_vs_trainer_max_abs"] = float(
            (torch.tensor(out[0].logprobs) - trainer_lp[0, :len(response)]).abs().max())
        # one ZeRO-3 step on a policy-gradient loss
        lp, _ = colo.actor.response_logprobs(batch)
        loss, _ = algos.policy_loss(lp, lp.detach(), torch.tensor([1.0]), batch.response_mask,
                                    num_tokens=float(batch.response_mask.sum()) * dist.world_size())
        colo.actor.backward(loss, last_micro_batch=True)
        report["step"] = colo.actor.step()
    state1 = colo.actor.full_state_dict_on_rank0()

    # --- generation phase 2: the engine must now hold the stepped weights
    with colo.switch.generation():
        engine_w1 = {n: p.detach().clone() for n, p in colo.engine.model.named_parameters()}
        _, engine_lp1 = fixed_sequence_logprobs(colo, tok, prompt, response)
    with colo.switch.update():
        trainer_lp1, _ = colo.actor.response_logprobs(batch, grad=False)
    report["engine_vs_trainer_after_step_max_abs"] = float((engine_lp1 - trainer_lp1).abs().max())
    report["engine_logprob_change"] = float((engine_lp1 - engine_lp).abs().max())
    if dist.is_rank0():
        report["engine_equals_trainer_before"] = all(torch.equal(engine_w0[n], state0[n]) for n in state0)
        report["engine_equals_trainer_after"] = all(torch.equal(engine_w1[n], state1[n]) for n in state1)
        report["weights_changed"] = sum(not torch.equal(state0[n], state1[n]) for n in state0)
        report["num_params"] = len(state0)
    report["ledger"] = colo.ledger.records
    Path(f"{out_path}.rank{dist.rank()}.json").write_text(json.dumps(report, default=str))
    dist.cleanup()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1], sys.argv[2]))

"""LoRA on the real colocated set under torchrun (2 gloo ranks, ZeRO-3, tiny model, HF engine):
tests/workers/lora_worker.py runs one handoff / step / handoff cycle per handoff mode and reports;
the assertions are here. The GRPO recipe with LoRA (resume included) is tests/test_lora_recipe.py."""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # ~1 min per mode on 2 CPU cores


@pytest.fixture(scope="module", params=["auto", "merged"])
def reports(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"lora_{request.param}")
    run_torchrun(WORKERS / "lora_worker.py", [str(d / "rep"), str(d), request.param], timeout=600)
    return request.param, [json.loads((d / f"rep.rank{r}.json").read_text()) for r in (0, 1)]


def test_only_adapters_are_trained(reports):
    _, reps = reports
    for rep in reps:
        assert rep["trainable_all_adapters"]
        # each rank's optimizer partition covers half the adapters (up to ZeRO's padding), nothing of the base
        assert rep["adapter_numel"] / 2 <= rep["optimizer_numel_this_rank"] < rep["adapter_numel"] / 2 + 64
        assert rep["adapter_numel"] < rep["total_numel"] / 100
        # paged state: fp32 master + Adam m, v + fp32 gradient of this rank's adapter partition, ZeRO's
        # fp32 gradient bucket (sized to all adapters) and this rank's partitions of the frozen base
        assert rep["state_bytes"] == (rep["optimizer_numel_this_rank"] * 16 + rep["adapter_numel"] * 4
                                      + rep["frozen_partition_bytes_this_rank"])
    changed = reps[0]["changed"]
    assert changed and all(".lora_" in n for n in changed), changed  # the step moved adapters only
    assert all(".lora_B." in n for n in changed)  # lora_B starts at 0, so lora_A's first gradient is 0


def test_engine_computes_the_trainers_logprobs_after_each_handoff(reports):
    _, reps = reports
    for rep in reps:
        assert rep["engine_vs_trainer_before"] < 1e-5
        assert rep["engine_vs_trainer_after"] < 1e-5
        assert rep["engine_change"] > 1e-2  # the step changed what the engine computes


def test_handoff_sends_the_base_once_then_only_adapters(reports):
    mode, reps = reports
    records = reps[0]["ledger"]
    handoffs = [m for r in records for m in r["moves"] if m["what"] == "weights handoff"]
    assert len(handoffs) == 2
    full_bytes = handoffs[0]["bytes"]
    assert full_bytes > 3_000_000 * 4  # the whole tiny model (3.29 M parameters, fp32)
    if mode == "auto":
        assert [h["content"] for h in handoffs] == ["base+adapters", "adapters"]
        assert handoffs[1]["bytes"] == reps[0]["adapter_numel"] * 4
        releases = [m for r in records for m in r["moves"] if m["what"].startswith("engine KV cache (release")]
        assert releases and all(m["what"] == "engine KV cache (release; weights kept)" for m in releases)
    else:  # the merged fallback: the whole (merged) model each time, the engine released between phases
        assert [h["content"] for h in handoffs] == ["merged", "merged"]
        assert handoffs[1]["bytes"] == full_bytes


def test_reference_is_the_base_with_adapters_disabled(reports):
    _, reps = reports
    for rep in reps:
        assert rep["ref_is_base"]
        assert rep["ref_vs_plain_base"] == 0.0 and rep["ref_after_step_vs_plain_base"] == 0.0
        assert rep["policy_vs_base_after_step"] > 1e-2


def test_export_loads_with_peft_and_as_a_merged_model(reports):
    rep = reports[1][0]
    assert rep["merged_vs_trainer"] < 1e-5
    assert rep["peft_vs_trainer"] < 1e-5


def test_checkpoint_holds_adapters_not_the_base_and_refuses_another_base(reports):
    _, reps = reports
    for rep in reps:
        assert not rep["ckpt_frozen_fragments"] and rep["ckpt_has_fingerprint"]
        # adapters + their fp32 optimizer state and pickling overhead: far below the base alone
        assert rep["ckpt_bytes"] < rep["base_bytes"] / 4, (rep["ckpt_bytes"], rep["base_bytes"])
        assert "cannot resume" in rep["changed_base_error"] and "model.path" in rep["changed_base_error"]
    assert reps[0]["loaded_equal"]  # a fresh actor (the base rebuilt, the adapters loaded) equals the saved one
    assert "on another rank" in reps[0]["changed_base_error"]
    assert "frozen tensors differ" in reps[1]["changed_base_error"]

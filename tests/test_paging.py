"""The trainer's paging between phases, on DeepSpeed's real offload_states path (2 gloo ranks, bf16):
tests/workers/paging_worker.py forces the paging that colo_rl does only on a GPU."""

from __future__ import annotations

import pytest

from tests.conftest import WORKERS, read_json, run_torchrun

BUFFERS = ["exp_avg_offload_buffer", "exp_avg_sq_offload_buffer"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("paging")
    run_torchrun(WORKERS / "paging_worker.py", [str(d / "rep"), str(d)], timeout=600)
    return [read_json(d / f"rep.rank{r}.json") for r in range(2)]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_paged_training_equals_unpaged(reports, mode):
    """Page-out / reload before every step changes nothing (LoRA: DeepSpeed alone failed here,
    mapping the frozen base's partitions onto the adapters' buffer)."""
    for rep in reports:
        r = rep[mode]
        assert r["page_outs"] == 2
        assert r["steps_paged"] == r["steps_plain"]
        assert r["weights_equal"]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_state_bytes_are_what_paging_moves(reports, mode):
    """The ledger's figure equals the bytes of the tensors paged (ZeRO's gradient bucket included),
    and that bucket is sized to the trained parameters, not DeepSpeed's 5e8 elements."""
    for rep in reports:
        r = rep[mode]
        assert r["state_bytes"] == r["moved_tensor_bytes"]
        # Adam's moments exist from set-up (DeepSpeed would make them at the first step): the
        # device holds at set-up what it holds in every later update phase
        assert r["moved_tensor_bytes_before_first_step"] == r["state_bytes_before_first_step"] == r["state_bytes"]
        assert r["reduce_bucket_size"] == r["trainable_numel"]
    if mode == "lora":  # the frozen base travels through colo_rl's own pager
        assert all(rep["lora"]["frozen_paged_bytes"] > 10 * rep["lora"]["trainable_numel"] for rep in reports)
    else:
        assert all(rep["full"]["frozen_paged_bytes"] == 0 for rep in reports)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_checkpoints_leave_out_deepspeeds_paging_buffers(reports, mode):
    for rep in reports:
        r = rep[mode]
        assert r["buffers_in_state"] == BUFFERS  # paging made them (what the rest is about)
        assert r["buffers_in_raw_checkpoint"] == BUFFERS  # DeepSpeed alone saves them
        assert r["buffers_in_colo_checkpoint"] == []
        assert r["buffers_in_state_after_save"] == BUFFERS  # kept in memory for the next page-out
        assert r["buffers_after_loading_raw"] == []  # an older checkpoint's are dropped on load
        assert r["loaded_weights_equal"]
        assert r["after_load_step"] == r["after_load_step_twin"]

"""colocate.paging=auto decides from an injected memory budget and DeepSpeed pages exactly that,
under real torchrun (2 gloo ranks, ZeRO-3, HF engine): tests/workers/paging_plan_worker.py."""

from __future__ import annotations

import json

import pytest
from conftest import WORKERS, read_json, run_torchrun

pytestmark = pytest.mark.slow
EXPECTED = ["contiguous_grad_buffer", "optim_states"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("paging_plan")
    run_torchrun(WORKERS / "paging_plan_worker.py", [str(d / "rep"), str(d)], timeout=600)
    return [read_json(d / f"rep.rank{r}.json") for r in range(2)], d


def test_the_plan_pages_the_least_that_fits_and_deepspeed_pages_exactly_that(reports):
    reps, _ = reports
    for rep in reps:
        assert rep["paged_kinds"] == EXPECTED
        # the generation phase: exactly the planned kinds left the device (the gradient bucket only
        # once it exists: DeepSpeed allocates it in the first backward)
        assert rep["offloaded_in_generation"][1] == EXPECTED
        assert set(rep["offloaded_in_generation"][0]) <= set(EXPECTED)
        assert rep["offloaded_in_update"] == [[], []]  # all back for the update
        assert rep["off_offloaded_in_generation"] == [[], []]
        by_kind = rep["state_bytes_by_kind"]
        assert sum(by_kind.values()) == rep["state_bytes"]
        assert rep["paged_bytes"] == by_kind["contiguous_grad_buffer"] + by_kind["optim_states"]


def test_partial_paging_trains_exactly_as_no_paging(reports):
    reps, _ = reports
    for rep in reps:
        assert rep["losses_paged"] == rep["losses_plain"] and rep["weights_equal"]


def test_the_decision_and_its_numbers_are_in_the_ledger(reports):
    reps, d = reports
    on_disk = [json.loads(line) for line in (d / "auto" / "ledger.jsonl").read_text().splitlines()]
    plan = on_disk[0]["paging_plan"]
    assert plan["paged"] == EXPECTED and plan["fits"] is True and plan["mode"] == "auto"
    assert plan["reason"].startswith("the least paging that fits")
    assert plan["device_gib"] == pytest.approx(reps[0]["budget"] / 2**30, abs=1e-3)
    assert all("paging_plan" not in rec for rec in on_disk[1:])
    moves = [m for rec in on_disk if rec["transition"] == "update->generation" for m in rec["moves"]
             if m["what"] == "trainer states"]
    assert moves and all(m["kinds"] == EXPECTED and m["moved"] for m in moves)
    assert moves[-1]["bytes"] == reps[0]["paged_bytes"]

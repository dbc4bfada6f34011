"""colocate.paging=auto's plan (colocate/paging_plan.py) on the issue's sample cases."""

from __future__ import annotations

import pytest
import torch

from colo_rl.colocate.paging_plan import (CUDA_GRAPH_BYTES, GIB, PAGE_ORDER, MemoryNeeds, activation_bytes,
                                          full_finetune_needs, kv_cache_needed, micro_batch_tokens, plan_paging)
from colo_rl.train.ds_config import paged_state_bytes, state_bytes_by_kind

BF16 = torch.bfloat16
H100 = 80 * 10**9  # what mem_get_info reports on an 80 GB card, roughly


def llama(h, layers, f, heads, kv_heads, vocab):
    return dict(hidden_size=h, num_hidden_layers=layers, intermediate_size=f, num_attention_heads=heads,
                num_key_value_heads=kv_heads, vocab_size=vocab)


SMOLLM2 = llama(576, 30, 1536, 9, 3, 49152)
HALF_B = llama(1024, 28, 4096, 16, 4, 32000)
LLAMA7B = llama(4096, 32, 11008, 32, 32, 32000)


def kv_per_token(cfg, tp=1, nbytes=2):
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * max(1, cfg["num_key_value_heads"] // tp) * head * nbytes


def full_ft(params, world, cfg, sequences, tokens_per_seq, mb_tokens, device=H100, ckpt=False):
    return full_finetune_needs(params, world, cfg, sequences, tokens_per_seq, mb_tokens, device,
                               gradient_checkpointing=ckpt)


def test_needs_from_shapes_are_the_terms_by_hand():
    needs = full_ft(135_000_000, 1, SMOLLM2, sequences=64, tokens_per_seq=100, mb_tokens=16384)
    assert needs.state("optim_states") == 8 * 135_000_000 and needs.state("lp_params") == 2 * 135_000_000
    assert needs.state("contiguous_grad_buffer") == 2 * 135_000_000  # capped at the parameter count
    assert needs.engine_weights == 2 * 135_000_000 and needs.handoff_buckets == 4 * 135_000_000
    assert needs.kv_cache == int(64 * 100 * kv_per_token(SMOLLM2) * 1.2)  # 23 KB a token
    assert full_ft(6_740_000_000, 8, LLAMA7B, 1, 1, 1).state("hp_params") == 4 * 842_500_000


def test_state_kinds_add_up_to_what_paging_moves():
    numel = 1000
    kinds = state_bytes_by_kind(numel, BF16, BF16, bucket_bytes=77)
    assert sum(kinds.values()) == paged_state_bytes(numel, BF16, BF16, include_lp_params=True) + 77
    fp32 = state_bytes_by_kind(numel, torch.float32, torch.float32)
    assert fp32["lp_params"] == 0  # fp32: the master weights are the params
    assert set(kinds) == set(PAGE_ORDER) - {"frozen_models"}


def test_135m_on_one_80gb_gpu_stays_resident():
    plan = plan_paging(full_ft(135_000_000, 1, SMOLLM2, sequences=64, tokens_per_seq=100, mb_tokens=16384))
    assert plan.fits and plan.paged == () and not plan.pages
    assert plan.reason == "everything fits with the trainer resident"
    assert 2.0 * GIB < sum(plan.needs.trainer_states.values()) < 2.6 * GIB  # the H100 run paged 2.25 GiB


def test_half_b_on_one_80gb_gpu_stays_resident():
    plan = plan_paging(full_ft(458_500_000, 1, HALF_B, sequences=128, tokens_per_seq=150 + 768 + 300,
                               mb_tokens=16384))
    assert plan.fits and plan.paged == ()
    assert plan.update_bytes < H100 and plan.generation_bytes < 30 * GIB


def test_7b_on_8_gpus_with_zero3_stays_resident():
    plan = plan_paging(full_ft(6_740_000_000, 8, LLAMA7B, sequences=32, tokens_per_seq=512 + 1024,
                               mb_tokens=4096, ckpt=True))
    assert plan.fits and plan.paged == (), plan.summary()


def test_a_model_that_needs_some_paging_pages_the_least_in_order():
    # 3B on one GPU: ~54 GB of states beside its engine and a large KV cache
    cfg = llama(3072, 28, 8192, 24, 8, 128256)
    needs = full_ft(3_200_000_000, 1, cfg, sequences=64, tokens_per_seq=3072, mb_tokens=4096, ckpt=True)
    plan = plan_paging(needs)
    assert plan.fits and plan.paged and plan.paged == PAGE_ORDER[:len(plan.paged)]
    assert "lp_params" not in plan.paged  # it fits before the weight partitions have to go
    fewer = plan_paging(needs, "off")
    assert not fewer.fits and "colocate.paging=auto" in fewer.reason
    # one kind fewer would not fit: the least paging
    shorter = plan.paged[:-1]
    resident = sum(needs.state(k) for k in PAGE_ORDER if k not in shorter)
    assert resident + needs.engine_weights + needs.kv_cache + needs.cuda_graphs + needs.margin > needs.device_bytes
    assert plan.generation_bytes <= needs.device_bytes


def test_a_model_that_does_not_fit_is_paged_whole_and_says_so():
    plan = plan_paging(full_ft(6_740_000_000, 1, LLAMA7B, sequences=64, tokens_per_seq=1024, mb_tokens=4096))
    assert not plan.fits and plan.paged == tuple(k for k in PAGE_ORDER if k != "frozen_models")
    assert "update phase alone" in plan.reason and "more GPUs" in plan.reason


def test_lora_7b_keeps_its_base_resident():
    adapters = 40_000_000
    states = state_bytes_by_kind(adapters, BF16, BF16, bucket_bytes=2 * adapters, frozen_base_bytes=2 * 6_740_000_000)
    needs = MemoryNeeds(device_bytes=H100, trainer_states=states,
                        activations=activation_bytes(LLAMA7B, 4096, 2, True), engine_weights=2 * 6_740_000_000,
                        kv_cache=kv_cache_needed(64, 1024, kv_per_token(LLAMA7B)), cuda_graphs=CUDA_GRAPH_BYTES,
                        handoff_buckets=0, margin=2 * GIB)
    plan = plan_paging(needs)
    assert plan.fits and plan.paged == ()
    # the same on a 40 GB card: the base (lp_params) is the last kind to go
    small = plan_paging(MemoryNeeds(**{**needs.__dict__, "device_bytes": 40 * 10**9}))
    assert small.paged[-1] == "lp_params" or not small.fits


def test_forced_modes_and_the_handoff_order():
    needs = full_ft(135_000_000, 1, SMOLLM2, sequences=64, tokens_per_seq=100, mb_tokens=2048)
    on = plan_paging(needs, "on")
    assert on.paged == PAGE_ORDER and on.fits and on.handoff_first  # room for the partitions at the handoff
    assert on.reason == "forced by colocate.paging=on"
    assert plan_paging(needs, "off").paged == ()
    tight = MemoryNeeds(**{**needs.__dict__, "device_bytes": on.handoff_bytes - 1})
    assert not plan_paging(tight, "on").handoff_first  # partitions paged first, the gathers copy them back
    with pytest.raises(ValueError, match="colocate.paging='sometimes'"):
        plan_paging(needs, "sometimes")


def test_the_record_carries_the_decision_and_its_numbers():
    rec = plan_paging(full_ft(135_000_000, 1, SMOLLM2, sequences=64, tokens_per_seq=100, mb_tokens=2048)).record()
    assert rec["paged"] == [] and rec["fits"] is True and rec["mode"] == "auto"
    assert rec["device_gib"] == pytest.approx(H100 / GIB, abs=1e-3) and rec["kv_cache_gib"] > 0
    assert set(rec["trainer_states_gib"]) == {"optim_states", "hp_params", "lp_params", "lp_grads",
                                              "contiguous_grad_buffer"}


def test_activation_estimate_and_token_budget():
    full = activation_bytes(HALF_B, 1000, 2, False)
    ckpt = activation_bytes(HALF_B, 1000, 2, True)
    assert ckpt < full / 3 and activation_bytes(HALF_B, 2000, 2, False) == 2 * full
    # Korthikanti et al.'s GeLU MLP keeps 34 h bytes per layer-token (f = 4h, MHA, dropout masks
    # included); a SwiGLU MLP keeps two more f-sized tensors and the rotated q, k
    per = activation_bytes(llama(1024, 1, 4096, 16, 16, 0), 1, 2, False)
    assert 34 * 1024 <= per <= 68 * 1024

    class T:
        micro_batch_size = 8
    assert micro_batch_tokens(T(), 300) == 2400
    T.micro_batch_tokens = 16384
    assert micro_batch_tokens(T(), 300) == 16384


def test_without_a_device_limit_auto_pages_nothing_and_on_still_pages_everything():
    needs = MemoryNeeds(**{**full_ft(135_000_000, 1, SMOLLM2, 64, 100, 2048).__dict__, "device_bytes": None})
    auto = plan_paging(needs)
    assert auto.paged == () and auto.fits and "CPU" in auto.reason and auto.record()["device_gib"] is None
    assert plan_paging(needs, "on").paged == PAGE_ORDER
    assert "no limit" in auto.summary()

"""LoRA pieces in one process (tiny random model, no DeepSpeed): merging, names, the HF engine
taking adapters unmerged, the handoff-mode choice by feature detection, SGLang's LoRA arguments,
config checks. The distributed paths: tests/test_lora_dist.py, tests/test_lora_recipe.py."""

from __future__ import annotations

import pytest
import torch

from colo_rl.colocate.handoff import choose_lora_handoff, engine_takes_adapters
from colo_rl.config import ConfigError, LoraConfig, ModelConfig, RunConfig, validate
from colo_rl.lora import adapter_config_dict, apply_lora, external_name, is_adapter, lora_scaling, merged_tensors
from colo_rl.models import load_model
from colo_rl.phase import Phase, PhaseGuard
from colo_rl.rollout.hf import HFEngine
from colo_rl.rollout.sglang.lora import ADAPTER_NAME, adapter_request, lora_engine_support, request_lora_paths

LORA = LoraConfig(rank=4, alpha=8.0)
TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32", lora=LORA)
IDS = torch.tensor([[5, 17, 300, 42, 9, 1000, 77]])


def trained_lora_model(seed: int = 3):
    """The tiny model with adapters whose lora_B is no longer zero (as after training)."""
    model = apply_lora(load_model(TINY, torch.float32, seed=1), LORA, seed=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def test_lora_forward_equals_the_merged_models_forward():
    model = trained_lora_model()
    plain = load_model(TINY, torch.float32, seed=99).eval()  # other weights: everything must come from the merge
    merged = dict(merged_tensors(list(model.named_parameters()), lora_scaling(LORA)))
    assert set(merged) == set(dict(plain.named_parameters()))
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        base = load_model(TINY, torch.float32, seed=1).eval()(IDS).logits
        lora_logits, merged_logits = model(IDS).logits, plain(IDS).logits
    assert (lora_logits - base).abs().max() > 1e-3  # the adapters do something
    torch.testing.assert_close(merged_logits, lora_logits, rtol=0, atol=2e-5)


def test_a_gpt2_conv1d_layer_merges_as_its_lora_forward():
    """transformers' Conv1D (GPT-2) stores its weight [in, out]: the merge adds (B @ A)^T there, as
    PEFT's fan_in_fan_out does; `c_proj` is square, so only the values tell."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from colo_rl.lora import transposed_modules

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=32, n_inner=64)
    base = GPT2LMHeadModel(config).eval()
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["c_attn", "c_proj"])
    model = apply_lora(GPT2LMHeadModel(config).eval(), lora, seed=1)
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    transposed = transposed_modules(model)
    assert sorted(n.split("transformer.h.0.")[1] for n in transposed) == ["attn.c_attn", "attn.c_proj", "mlp.c_proj"]
    merged = dict(merged_tensors(list(model.named_parameters()), lora_scaling(lora), transposed))
    base.load_state_dict(merged, strict=False)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, model.eval()(ids).logits, rtol=0, atol=2e-5)


def test_an_adapter_on_a_head_tied_to_the_embedding_is_refused():
    """SmolLM2 ties lm_head to the input embedding: its weight is listed once, as the embedding, so
    an adapter on it would be left out of every merge (engine and export)."""
    with pytest.raises(ConfigError, match=r"\['lm_head'\] share their weight with the input embedding"):
        apply_lora(load_model(TINY, torch.float32, seed=1), LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]),
                   seed=1)
    untied = load_model(TINY, torch.float32, seed=1)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())  # a head of its own
    wrapped = apply_lora(untied, LoraConfig(rank=2, target_modules=["lm_head"]), seed=1)
    assert any("lm_head.lora_A" in n for n, _ in wrapped.named_parameters())


def test_names_travel_as_hf_base_names_and_adapter_file_names():
    assert external_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert external_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert external_name("base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert external_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"  # plain model
    assert is_adapter("x.q_proj.lora_A.default.weight") and not is_adapter("x.q_proj.base_layer.weight")


def engine_for(model):
    guard = PhaseGuard()
    guard.phase = Phase.GENERATION
    return HFEngine(model, [0], 0, guard=guard, max_batch=4, seed=0)


def test_hf_engine_takes_the_base_once_then_adapters_unmerged():
    trainer = trained_lora_model()
    engine = engine_for(apply_lora(load_model(TINY, torch.float32, seed=7), LORA, seed=5))
    assert engine.supports_adapters() and engine_takes_adapters(engine)
    engine.sleep()
    engine.wake()  # garbage until the handoff
    named = [(external_name(n), p.detach()) for n, p in trainer.named_parameters()]
    engine.load_weights([(n, t) for n, t in named if not is_adapter(n)])
    engine.load_adapter([(n, t) for n, t in named if is_adapter(n)])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(IDS).logits, trainer(IDS).logits, rtol=0, atol=0)
    # unmerged: the engine's base weights are the plain base, not base + B A
    base = dict(load_model(TINY, torch.float32, seed=1).named_parameters())
    assert torch.equal(engine.params["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    # a new adapter alone changes what the engine computes
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".lora_B." in name:
                p.mul_(2)
    engine.load_adapter([(external_name(n), p.detach()) for n, p in trainer.named_parameters() if is_adapter(n)])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(IDS).logits, trainer(IDS).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="base weights"):
        engine.load_adapter(named[:1])


def test_handoff_mode_is_chosen_by_what_the_engine_can_do():
    lora_engine = engine_for(apply_lora(load_model(TINY, torch.float32, seed=1), LORA, seed=1))
    plain_engine = engine_for(load_model(TINY, torch.float32, seed=1))
    assert choose_lora_handoff(TINY, lora_engine)[0] == "adapter"
    mode, why = choose_lora_handoff(TINY, plain_engine)
    assert mode == "merged" and "HFEngine" in why
    assert choose_lora_handoff(TINY, None)[0] == "adapter"  # a rank that only joins the gathers
    merged_cfg = ModelConfig(random_init=True, lora=LoraConfig(rank=4, handoff="merged"))
    assert choose_lora_handoff(merged_cfg, lora_engine) == ("merged", "model.lora.handoff=merged")
    assert choose_lora_handoff(ModelConfig(), plain_engine)[0] == "full"


class SGLangWithTensorLoRA:  # the two methods SGLang 0.5.17 / 0.5.21's Engine has
    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None): ...

    def unload_lora_adapter(self, lora_name): ...


class OlderSGLang:
    def load_lora_adapter(self, lora_name, lora_path, pinned=False): ...


def test_sglang_takes_adapters_only_with_the_tensor_api_and_one_tp_rank():
    assert lora_engine_support(TINY, SGLangWithTensorLoRA, 1) == (True, "Engine.load_lora_adapter_from_tensors")
    ok, why = lora_engine_support(TINY, OlderSGLang, 1)
    assert not ok and "load_lora_adapter_from_tensors" in why
    ok, why = lora_engine_support(TINY, SGLangWithTensorLoRA, 2)
    assert not ok and "tp_size=2" in why
    assert not lora_engine_support(ModelConfig(), SGLangWithTensorLoRA, 1)[0]
    named = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64))]
    req = adapter_request(named, TINY)
    assert req["lora_name"] == ADAPTER_NAME and list(req["tensors"]) == [named[0][0]]
    cfg = req["config_dict"]
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert cfg["target_modules"] == sorted(LORA.target_modules)
    assert request_lora_paths(False, 3) is None and request_lora_paths(True, 2) == [ADAPTER_NAME] * 2


def test_adapter_config_round_trips_through_peft():
    from peft import LoraConfig as PeftLoraConfig

    cfg = PeftLoraConfig.from_peft_type(**adapter_config_dict(LORA))
    assert cfg.r == 4 and cfg.lora_alpha == 8.0 and set(cfg.target_modules) == set(LORA.target_modules)


@pytest.mark.parametrize("key,value,match", [("rank", -1, "model.lora.rank"), ("alpha", 0.0, "model.lora.alpha"),
                                             ("dropout", 1.0, "model.lora.dropout"),
                                             ("target_modules", [], "model.lora.target_modules"),
                                             ("handoff", "adapters", "model.lora.handoff")])
def test_bad_lora_settings_are_refused_at_start_up(key, value, match):
    cfg = RunConfig()
    setattr(cfg.model.lora, key, value)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


@pytest.mark.parametrize("targets,missing", [(["q_proj", "qkv_proj"], ["qkv_proj"]),
                                             (["qproj", "vproj"], ["qproj", "vproj"])])  # every one wrong: PEFT's own error
def test_a_target_module_the_model_lacks_is_named_with_the_models_own_linear_layers(targets, missing):
    model = load_model(TINY, torch.float32, seed=1)
    with pytest.raises(ConfigError) as e:
        apply_lora(model, LoraConfig(rank=2, target_modules=targets), seed=1)
    assert f"{missing} match no linear layer of this model; its linear layers are ['down_proj', 'gate_proj', " \
           "'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in str(e.value)
    assert not any("lora" in n for n, _ in model.named_parameters())  # refused before PEFT touched the model
    wrapped = apply_lora(model, LoraConfig(rank=2, target_modules=["self_attn.q_proj"]), seed=1)  # a dotted tail
    assert any("q_proj.lora_A" in n for n, _ in wrapped.named_parameters())


def test_a_checkpoint_from_before_lora_resumes_with_lora_off_and_is_refused_with_it_on():
    from colo_rl.checkpoint import compare_configs, config_container

    saved = config_container(RunConfig())
    del saved["model"]["lora"]  # written before model.lora existed
    assert compare_configs(saved, config_container(RunConfig())) == ([], [])
    with_lora = RunConfig()
    with_lora.model.lora.rank = 8
    refusals, _ = compare_configs(saved, config_container(with_lora))
    assert [r.split(":")[0] for r in refusals] == ["model.lora.rank"]


def test_tensor_fingerprint_sees_every_change_and_not_the_layout():
    from colo_rl.lora import fingerprint_differences, tensor_fingerprint

    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    fp = tensor_fingerprint(t)
    assert tensor_fingerprint(t.clone().reshape(10, 100)) == fp
    assert tensor_fingerprint(t, chunk=7) == fp  # chunking does not change the sums
    flipped = t.clone()
    flipped.view(torch.int32)[500] ^= 1  # the lowest mantissa bit of one element
    assert tensor_fingerprint(flipped)[0] != fp[0]
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]  # same values, other places: only the weighted sum sees it
    assert tensor_fingerprint(swapped)[0] == fp[0] and tensor_fingerprint(swapped)[1] != fp[1]
    assert tensor_fingerprint(t.to(torch.bfloat16)) != tensor_fingerprint(t.to(torch.bfloat16) * 2)
    # a fingerprint read back from a checkpoint may come as lists; names on one side only differ
    saved = {"a": list(fp), "b": [1, 2]}
    assert fingerprint_differences(saved, {"a": fp, "b": (1, 2)}) == []
    assert fingerprint_differences(saved, {"a": fp, "c": (1, 2)}) == ["b", "c"]


def test_local_part_leaves_out_the_last_shards_padding(monkeypatch):
    """ZeRO-3 pads each parameter to a multiple of the world size; the last rank's padding is
    uninitialised memory, so the fingerprint must not read it."""
    import types

    import torch.distributed as tdist

    from colo_rl.lora import local_part

    shard = torch.arange(4.0)  # 10 elements over 3 ranks: shards of 4, the last holds 2 + 2 padding
    param = types.SimpleNamespace(ds_tensor=shard, ds_numel=10, ds_process_group=None)
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    for rank, numel in ((0, 4), (1, 4), (2, 2)):
        monkeypatch.setattr(tdist, "get_rank", lambda group=None, r=rank: r)
        assert local_part(param).numel() == numel


def test_the_exported_merge_of_a_bf16_run_is_the_runs_own_merge():
    """`python -m colo_rl.checkpoint` merges with PEFT: in fp32 from the run's bf16 weights, rounded
    once, it gives exactly what the run's own merge (lora.merged_tensors) gives; merging in bf16
    rounds twice (what the export did)."""
    import copy

    model = trained_lora_model().to(torch.bfloat16)
    run = dict(merged_tensors(list(model.named_parameters()), lora_scaling(LORA)))
    exported = copy.deepcopy(model).float().merge_and_unload().to(torch.bfloat16).state_dict()
    assert all(torch.equal(exported[n], t) for n, t in run.items())
    in_bf16 = copy.deepcopy(model).merge_and_unload().state_dict()
    assert any(not torch.equal(in_bf16[n], t) for n, t in run.items())


def test_partition_bounds_cover_each_element_once_as_zero3_shards_do():
    """ZeRO-3 pads a tensor to a multiple of the world size and cuts equal shards: rank r holds
    [r*s, (r+1)*s) of the real elements (s = ceil(numel / world)); the last ranks may hold none."""
    from colo_rl.lora import partition_bounds

    assert [partition_bounds(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    for numel in (1, 7, 64, 1001):
        for world in (1, 2, 3, 8):
            parts = [partition_bounds(numel, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert all(stop - start <= -(-numel // world) for start, stop in parts)

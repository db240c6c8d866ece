"""The rehearsal target of the DeepSeek-V3 family (target=tiny-moe, moe-rehearsal's architecture at
test size): built once from its config into a sharded safetensors folder with an index and SmolLM2's
tokenizer, and its aux-layer capture equal to HF's hidden_states at the engines' indices."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.core.common import compose
from eagle3.core.target import (
    capture_hidden_states,
    default_aux_layer_ids,
    load_target,
    resolve_target_path,
    smollm2_tokenizer,
)


def tiny_moe_cfg(test_root, *overrides):
    return compose([f"paths.root={test_root}", "target=tiny-moe", *overrides])


def test_tiny_moe_is_a_sharded_deepseek_v3_folder_with_smollm2_tokens(test_root):
    cfg = tiny_moe_cfg(test_root)
    folder = resolve_target_path(cfg.target, test_root / "artifacts")
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((folder / s).exists() for s in shards)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["model_type"], config["topk_method"], config["scoring_func"]) == (
        "deepseek_v3",
        "noaux_tc",
        "sigmoid",
    )
    names = set(index["weight_map"])
    # MLA attention in every layer; layer 0 dense, layers 1-4 8 routed experts + 1 shared expert
    assert all(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" in names for i in range(5))
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)
    for layer in range(1, 5):
        experts = {n.split(".")[5] for n in names if f"layers.{layer}.mlp.experts." in n}
        assert experts == {str(e) for e in range(8)}
        assert f"model.layers.{layer}.mlp.shared_experts.down_proj.weight" in names
    smollm2 = smollm2_tokenizer(test_root / "artifacts")
    with safe_open(str(folder / index["weight_map"]["model.embed_tokens.weight"]), "pt") as f:
        rows = f.get_slice("model.embed_tokens.weight").get_shape()[0]
    assert rows == config["vocab_size"] == len(smollm2)
    before = (folder / shards[0]).stat().st_mtime_ns
    assert resolve_target_path(cfg.target, test_root / "artifacts") == folder  # built once
    assert (folder / shards[0]).stat().st_mtime_ns == before


def test_moe_aux_capture_equals_hidden_states_at_engine_indices(test_root):
    """The hooks read the inputs of the decoder layers; HF's hidden_states[i] is the input of
    layer i: both must agree on MLA + MoE layers, padded batches included."""
    cfg = tiny_moe_cfg(test_root)
    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    layers = target.num_layers
    for layer_ids in (target.aux_layer_ids, default_aux_layer_ids(layers), [0, 1, layers - 1]):
        aux, last = capture_hidden_states(target.model, ids, layer_ids, mask)
        with torch.no_grad():
            out = target.model(ids, attention_mask=mask, output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
        assert torch.equal(aux, expected), layer_ids
        assert torch.equal(last, out.hidden_states[-1])
    assert type(target.model).__name__ == "DeepseekV3ForCausalLM"


def test_bench_refuses_the_embedded_engine_for_latent_attention(make_cfg, tmp_path):
    """serve=local stops before looking for a drafter, naming the engines that serve the target;
    a Llama target passes the same check."""

    from eagle3.bench import app as bench
    from eagle3.bench import checks
    from eagle3.core.common import Eagle3Error
    from eagle3.core.target import resolve_target_path

    cfg = make_cfg("target=tiny-moe", "serve=local", "spec.depth=4")
    with pytest.raises(Eagle3Error) as refused:
        bench.measure_job(bench.bench_job(cfg), tmp_path / "job")
    assert str(refused.value) == (
        "serve=local cannot run target tiny-moe (deepseek_v3: multi-head latent attention, which "
        "the embedded engine does not implement); use serve=sglang or serve=vllm"
    )
    llama = make_cfg("target=tiny-llama", "serve=local")
    checks.check_engine_supports(
        llama.serve.engine, llama.target, resolve_target_path(llama.target, llama.paths.artifacts)
    )


def test_rehearsal_targets_have_kimi_k25_head_sizes_and_routing():
    """The engines' MLA kernels take a 512 + 64 latent (SGLang's triton decode kernel fails at
    start on 128 + 32): moe-rehearsal and tiny-moe keep Kimi-K2.5's per-head sizes and routing."""
    kimi = dict(compose(["experiment=kimi-k2.5"]).target.plan["config"])
    per_head = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    routing = {
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "num_experts_per_tok": 8,
    }
    for name in ("moe-rehearsal", "tiny-moe"):
        shapes = dict(compose([f"target={name}"]).target.architecture)
        assert {k: shapes[k] for k in per_head} == {k: kimi[k] for k in per_head}, name
        assert shapes["kv_lora_rank"] + shapes["qk_rope_head_dim"] == 576
    rehearsal = dict(compose(["target=moe-rehearsal"]).target.architecture)
    assert rehearsal["q_lora_rank"] == kimi["q_lora_rank"] == 1536
    assert {k: rehearsal[k] for k in routing} == routing

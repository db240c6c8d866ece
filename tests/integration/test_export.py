"""Export / import / registry: engine folder layout, key+shape refusal, aux-id conventions,
bit-exact round trips through every supported folder variant, models:/ resolution."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import SGLANG_PYTHON, VLLM_PYTHON, randomise

from eagle3.core import drafter_io, outputs
from eagle3.core.common import Eagle3Error
from eagle3.core.drafter import build_drafter
from eagle3.core.target import default_aux_layer_ids
from eagle3.export import stage as export

RECIPE = {
    "ttt_length": 7,
    "step_decay": 0.8,
    "vocab_map_hash": "abc",
    "data_hash": "def",
    "tau_hat": 2.5,
}


@pytest.fixture(scope="module")
def shared_mlflow(tmp_path_factory):
    """One MLflow store for this module's registry tests (creating a sqlite store costs ~10 s)."""
    root = tmp_path_factory.mktemp("mlruns")
    return [
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"tracking.artifact_location={root}/artifacts",
    ]


@pytest.fixture
def drafter(tiny_target, make_cfg):
    return randomise(build_drafter(tiny_target, make_cfg("target=tiny-llama").drafter))


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def draft_step(drafter, seed: int = 1):
    """One drafting step on fixed random inputs with a causal mask: the logits."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, drafter.config.vocab_size, (1, 6), generator=generator)
    aux = torch.randn(1, 6, 3 * drafter.config.target_hidden_size, generator=generator).to(
        drafter.fc.weight.dtype
    )
    positions = torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    from eagle3.core.drafter import sdpa

    with torch.no_grad():
        hidden = drafter(
            ids, drafter.project(aux), positions, lambda i, q, k, v: sdpa(q, k, v, causal)
        )
        return drafter.logits(hidden)


# ---------------------------------------------------------------- the SGLang folder


def test_sglang_folder_has_exactly_the_engine_keys_and_config(drafter, tiny_target, tmp_path):
    folder = drafter_io.export_sglang(drafter, tmp_path / "sglang", RECIPE)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    hidden, target_hidden = drafter.config.hidden_size, tiny_target.hidden_size
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 8192 and config["target_hidden_size"] == target_hidden
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] >= tiny_target.config.max_position_embeddings
    assert config["rope_theta"] == 10000.0
    assert config["eagle3"]["recipe"] == RECIPE and config["eagle3"]["aux_layer_ids_hf"] == [
        1,
        2,
        3,
    ]
    midlayer = {
        f"midlayer.{n}.weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        )
    }
    assert set(tensors) == midlayer | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert tensors["fc.weight"].shape == (hidden, 3 * target_hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (hidden, 2 * hidden)
    assert tensors["lm_head.weight"].shape == (8192, hidden)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["t2d"].shape == (tiny_target.vocab_size,) and int(tensors["t2d"].sum()) == 8192
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], drafter.layers[0].hidden_norm.weight)


def test_multi_layer_drafter_exports_layers_i_in_each_engines_names(
    tiny_target, make_cfg, tmp_path
):
    """Layers after the first: vLLM names their input norm input_layernorm, SGLang hidden_norm
    (SGLang's LlamaDecoderLayer fuses the residual add into hidden_norm; same function)."""
    two_layers = randomise(
        build_drafter(tiny_target, make_cfg("target=tiny-llama", "drafter.num_layers=2").drafter)
    )
    for engine, later, absent in (
        ("vllm", "input_layernorm", "hidden_norm"),
        ("sglang", "hidden_norm", "input_layernorm"),
    ):
        folder = drafter_io.export_sglang(two_layers, tmp_path / engine, RECIPE, engine=engine)
        tensors = load_file(str(folder / "model.safetensors"))
        assert not any(k.startswith("midlayer.") for k in tensors)
        assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64
        assert tensors["layers.1.self_attn.q_proj.weight"].shape[1] == 64
        assert torch.equal(
            tensors[f"layers.1.{later}.weight"], two_layers.layers[1].input_layernorm.weight
        )
        assert f"layers.1.{absent}.weight" not in tensors and len(tensors) == 5 + 10 + 9
        loaded = drafter_io.attach_target_embedding(
            drafter_io.load_drafter(folder, aux_convention=engine), tiny_target
        )
        assert_same_weights(loaded, two_layers)
        assert torch.equal(draft_step(loaded), draft_step(two_layers))


# ---------------------------------------------------------------- refusing to write


def test_wrongly_named_checkpoint_is_rejected_listing_keys(drafter, tmp_path):
    """`layers.0.*` where SGLang requires `midlayer.*`: the bug that served acceptance 1.00."""
    tensors = drafter_io.engine_tensors(drafter, "speculators")  # layers.0.* names
    config = drafter_io.sglang_config(drafter, RECIPE, "sglang", torch.float32)
    with pytest.raises(Eagle3Error) as err:
        drafter_io.write_folder(
            tensors, config, drafter_io.expected_shapes(drafter.config, "sglang"), tmp_path / "bad"
        )
    message = str(err.value)
    assert "20 key/shape problem(s)" in message
    assert "missing midlayer.self_attn.q_proj.weight [64, 128]" in message
    assert "unexpected layers.0.self_attn.q_proj.weight [64, 128]" in message
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()


def test_wrong_shape_dtype_and_unset_vocab_map_are_rejected(
    drafter, tiny_target, make_cfg, tmp_path
):
    expected = drafter_io.expected_shapes(drafter.config, "sglang")
    config = drafter_io.sglang_config(drafter, RECIPE, "sglang", torch.float32)
    tensors = drafter_io.engine_tensors(drafter, "sglang")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:100]
    tensors["d2t"] = tensors["d2t"].int()
    with pytest.raises(
        Eagle3Error,
        match=r"d2t has dtype torch.int32, expected torch.int64; "
        r"lm_head.weight has shape \[100, 64\], expected \[8192, 64\]",
    ):
        drafter_io.write_folder(tensors, config, expected, tmp_path / "bad")
    fresh = build_drafter(tiny_target, make_cfg("target=tiny-llama").drafter)  # vocab map never set
    with pytest.raises(Eagle3Error, match="d2t and t2d disagree"):
        drafter_io.export_sglang(fresh, tmp_path / "fresh", RECIPE)
    assert not (tmp_path / "fresh").exists()


def test_existing_folder_is_replaced_only_after_checks(drafter, tmp_path):
    folder = drafter_io.export_sglang(drafter, tmp_path / "out", RECIPE)
    before = (folder / "model.safetensors").read_bytes()
    drafter.t2d.zero_()
    with pytest.raises(Eagle3Error):
        drafter_io.export_sglang(drafter, folder, RECIPE)
    assert (folder / "model.safetensors").read_bytes() == before


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_import_is_bit_exact(drafter, tiny_target, tmp_path, dtype):
    folder = drafter_io.export_sglang(drafter, tmp_path / "sglang", RECIPE, dtype=dtype)
    loaded = drafter_io.attach_target_embedding(drafter_io.load_drafter(folder), tiny_target)
    reference = drafter if dtype is None else drafter.to(torch.bfloat16)
    assert_same_weights(loaded, reference)
    assert torch.equal(draft_step(loaded), draft_step(reference))
    assert loaded.config.aux_layer_ids == [1, 2, 3] and loaded.config.recipe == RECIPE


def test_embedding_included_on_request(drafter, tiny_target, tmp_path):
    folder = drafter_io.export_sglang(drafter, tmp_path / "emb", RECIPE, include_embedding=True)
    assert "embed_tokens.weight" in load_file(str(folder / "model.safetensors"))
    loaded = drafter_io.load_drafter(folder)  # no target needed
    assert loaded.config.has_embedding
    assert_same_weights(loaded, drafter)


def test_speculators_folder_round_trip(drafter, tiny_target, tmp_path):
    folder = drafter_io.export_speculators(
        drafter, tmp_path / "spec", RECIPE, speculative_tokens=5, verifier="tiny"
    )
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]  # vLLM reads HF indices as written
    assert "layers.0.hidden_norm.weight" in tensors and not any(
        k.startswith("midlayer") for k in tensors
    )
    assert_same_weights(
        drafter_io.attach_target_embedding(drafter_io.load_drafter(folder), tiny_target), drafter
    )


# ---------------------------------------------------------------- aux-layer id conventions


def test_custom_aux_ids_are_written_in_each_engines_convention(drafter, tmp_path):
    """tiny-llama captures HF hidden_states[1, 2, 3]: vLLM reads ids as HF indices, SGLang adds 1."""
    sglang = drafter_io.export_sglang(drafter, tmp_path / "sglang", RECIPE, engine="sglang")
    vllm = drafter_io.export_sglang(drafter, tmp_path / "vllm", RECIPE, engine="vllm")
    sglang_ids = json.loads((sglang / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    vllm_ids = json.loads((vllm / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    assert sglang_ids == [0, 1, 2] and vllm_ids == [1, 2, 3]
    assert json.loads((vllm / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads(
        (sglang / "config.json").read_text()
    )
    # What each engine captures from those ids (their sources): SGLang layers_to_capture = id + 1,
    # both capturing the input of that decoder layer = HF hidden_states[id].
    assert [i + 1 for i in sglang_ids] == vllm_ids == [1, 2, 3]
    # Without our recipe key, import reads the ids in the convention the folder was written for.
    for folder, convention in ((sglang, "sglang"), (vllm, "vllm")):
        config = json.loads((folder / "config.json").read_text())
        del config["eagle3"]
        (folder / "config.json").write_text(json.dumps(config))
        assert drafter_io.load_drafter(folder, aux_convention=convention).config.aux_layer_ids == [
            1,
            2,
            3,
        ]


def test_default_aux_ids_write_no_ids_and_engines_agree(drafter, tmp_path):
    """A 30-layer target captured at the engines' default [2, 15, 27]: no ids in either folder."""
    drafter.config.aux_layer_ids = default_aux_layer_ids(30)
    drafter.config.target_num_layers = 30
    for engine in ("sglang", "vllm"):
        folder = drafter_io.export_sglang(drafter, tmp_path / engine, RECIPE, engine=engine)
        config = json.loads((folder / "config.json").read_text())
        assert "eagle_config" not in config
        assert config["eagle3"]["aux_layer_ids_hf"] == [2, 15, 27]
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads(
        (
            drafter_io.export_speculators(drafter, tmp_path / "spec", RECIPE) / "config.json"
        ).read_text()
    )
    assert drafter_io.engine_aux_ids([2, 15, 27], "sglang") == [1, 14, 26]
    assert drafter_io.engine_aux_ids([2, 15, 27], "vllm") == [2, 15, 27]


def test_foreign_folder_without_ids_gets_the_targets_default(drafter, tiny_target, tmp_path):
    folder = drafter_io.export_sglang(drafter, tmp_path / "x", RECIPE)
    config = json.loads((folder / "config.json").read_text())
    del config["eagle3"], config["eagle_config"]
    (folder / "config.json").write_text(json.dumps(config))
    loaded = drafter_io.load_drafter(folder)
    assert loaded.config.aux_layer_ids is None
    # The engines would capture [2, 2, 1] on a 4-layer target; tiny-llama trains on [1, 2, 3].
    with pytest.raises(Eagle3Error, match=r"aux layers \[2, 2, 1\].*captures \[1, 2, 3\]"):
        drafter_io.check_drafter_for_target(loaded, tiny_target)


# ---------------------------------------------------------------- importing published variants


def write_foreign(
    folder: Path, tensors: dict, config: dict, weights: str = "model.safetensors"
) -> Path:
    folder.mkdir(parents=True)
    if weights.endswith(".bin"):
        torch.save(tensors, folder / weights)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / weights))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def foreign_config(drafter, **extra) -> dict:
    config = drafter_io.sglang_config(drafter, {}, "sglang", torch.float32)
    del config["eagle3"]
    return {**config, **extra}


def test_import_specforge_folder_with_embedding_and_sglang_ids(drafter, tiny_target, tmp_path):
    tensors = drafter_io.engine_tensors(drafter, "sglang", include_embedding=True)
    folder = write_foreign(tmp_path / "specforge", tensors, foreign_config(drafter))
    loaded = drafter_io.load_drafter(folder)
    assert loaded.config.aux_layer_ids == [1, 2, 3]  # eagle_config [0, 1, 2] read as SGLang ids
    assert_same_weights(loaded, drafter)
    drafter_io.check_drafter_for_target(loaded, tiny_target)


def test_import_eagle_bin_with_model_prefix(drafter, tmp_path):
    tensors = {
        ("model." + k if k != "lm_head.weight" else k): v
        for k, v in drafter_io.engine_tensors(drafter, "sglang", include_embedding=True).items()
    }
    folder = write_foreign(
        tmp_path / "eagle", tensors, foreign_config(drafter), weights="pytorch_model.bin"
    )
    assert_same_weights(drafter_io.load_drafter(folder), drafter)


def test_import_stacked_projections(drafter, tmp_path):
    tensors = drafter_io.engine_tensors(drafter, "speculators", include_embedding=True)
    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    tensors[attn + "qkv_proj.weight"] = torch.cat(
        [tensors.pop(attn + f"{p}_proj.weight") for p in "qkv"]
    )
    tensors[mlp + "gate_up_proj.weight"] = torch.cat(
        [tensors.pop(mlp + f"{p}_proj.weight") for p in ("gate", "up")]
    )
    folder = write_foreign(tmp_path / "stacked", tensors, foreign_config(drafter))
    assert_same_weights(drafter_io.load_drafter(folder), drafter)


def test_import_speculators_variants(drafter, tmp_path):
    good = drafter_io.export_speculators(drafter, tmp_path / "spec", RECIPE, include_embedding=True)
    config = json.loads((good / "config.json").read_text())
    del config["norm_before_residual"]  # absent = vLLM's default true: another architecture
    bad = write_foreign(tmp_path / "bad", load_file(str(good / "model.safetensors")), config)
    with pytest.raises(Eagle3Error, match="norm_before_residual is not supported"):
        drafter_io.load_drafter(bad)
    assert_same_weights(drafter_io.load_drafter(good), drafter)


def test_import_refuses_unknown_and_missing_keys(drafter, tmp_path):
    tensors = drafter_io.engine_tensors(drafter, "sglang")
    tensors["fc.bias"] = torch.zeros(64)
    del tensors["norm.weight"]
    folder = write_foreign(tmp_path / "odd", tensors, foreign_config(drafter))
    with pytest.raises(Eagle3Error, match=r"missing norm.weight \[64\]; unexpected fc.bias \[64\]"):
        drafter_io.load_drafter(folder)


# ---------------------------------------------------------------- pairing with a target


def test_check_drafter_for_target_names_each_mismatch(drafter, tiny_target):
    from eagle3.core.target import tokenizer_hash

    drafter_io.check_drafter_for_target(drafter, tiny_target)
    drafter.config.recipe = {"tokenizer_hash": tokenizer_hash(tiny_target.tokenizer)}
    drafter_io.check_drafter_for_target(
        drafter, tiny_target
    )  # the hash is computed from the target's tokenizer
    drafter.config.target_hidden_size = 128
    drafter.config.max_position_embeddings = 1024
    drafter.config.recipe = {"tokenizer_hash": "aaa"}
    with pytest.raises(Eagle3Error) as err:
        drafter_io.check_drafter_for_target(drafter, tiny_target, tokenizer_hash="bbb")
    assert "target hidden size 128, target has 64" in str(err.value)
    assert "max_position_embeddings 1024 < the target's 2048" in str(err.value)
    assert "vocab map built with tokenizer aaa, target tokenizer is bbb" in str(err.value)


# ---------------------------------------------------------------- registry and drafter.path


def test_register_and_resolve_models_uri(drafter, tiny_target, make_cfg, tmp_path, shared_mlflow):
    from mlflow.tracking import MlflowClient

    from eagle3.core.tracking import client, stage_run

    cfg = make_cfg(
        "target=tiny-llama",
        f"paths.artifacts={tmp_path}/artifacts",
        *shared_mlflow,
        "export.registry_name=registry-test",
    )
    out_dir = tmp_path / "export"
    folders = export.export_drafter(cfg.export, cfg.target, drafter, RECIPE, out_dir)
    assert sorted(folders) == ["sglang", "vllm"]
    with stage_run(cfg, "export") as run:
        name = export.registry_name(cfg.export, cfg.target)
        version = export.register_export(
            client(cfg.tracking), name, "tiny-llama", out_dir, RECIPE, run
        )
    assert name == "registry-test" and version == "1"
    tags = MlflowClient(cfg.tracking.uri).get_model_version("registry-test", "1").tags
    assert (
        tags["tau_hat"] == "2.5"
        and tags["recipe.ttt_length"] == "7"
        and tags["recipe.step_decay"] == "0.8"
    )

    uri_cfg = make_cfg(
        "target=tiny-llama",
        f"paths.artifacts={tmp_path}/artifacts",
        *shared_mlflow,
        "drafter.path=models:/registry-test/1",
    )
    for engine in ("sglang", "vllm"):
        folder = outputs.resolve_drafter_path(uri_cfg, engine)
        assert folder.name == engine and folder.is_relative_to(tmp_path / "artifacts" / "registry")
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cached = tmp_path / "artifacts" / "registry" / "registry-test" / "1"
    assert sorted(p.name for p in cached.iterdir()) == ["drafter"]
    stamp = (cached / "drafter" / "sglang" / "model.safetensors").stat().st_mtime_ns
    outputs.resolve_drafter_path(uri_cfg)  # a second resolve reuses the download
    assert (cached / "drafter" / "sglang" / "model.safetensors").stat().st_mtime_ns == stamp
    loaded = drafter_io.attach_target_embedding(
        drafter_io.load_drafter(outputs.resolve_drafter_path(uri_cfg)), tiny_target
    )
    assert_same_weights(loaded, drafter)
    latest = drafter_io.load_drafter("models:/registry-test/latest", tracking_uri=cfg.tracking.uri)
    assert loaded.config.aux_layer_ids == latest.config.aux_layer_ids == [1, 2, 3]
    with pytest.raises(Eagle3Error, match="not in the model registry"):
        outputs.resolve_drafter_path(
            make_cfg("target=tiny-llama", *shared_mlflow, "drafter.path=models:/registry-test/7")
        )


def test_resolve_drafter_path_errors_say_what_to_run(make_cfg, tmp_path):
    with pytest.raises(Eagle3Error, match="does not exist"):
        outputs.resolve_drafter_path(make_cfg(f"drafter.path={tmp_path}/nowhere"))
    with pytest.raises(
        Eagle3Error,
        match=r"python -m eagle3.pipeline.*python -m eagle3.train.*python -m eagle3.export",
    ):
        outputs.resolve_drafter_path(
            make_cfg("target=tiny-llama", f"paths.artifacts={tmp_path}/empty")
        )


def test_resolve_drafter_path_accepts_a_folder_or_an_export(drafter, make_cfg, tmp_path):
    cfg = make_cfg("target=tiny-llama")
    export.export_drafter(cfg.export, cfg.target, drafter, RECIPE, tmp_path / "exp")
    assert (
        outputs.resolve_drafter_path(make_cfg(f"drafter.path={tmp_path}/exp"), "vllm")
        == tmp_path / "exp" / "vllm"
    )
    with pytest.raises(Eagle3Error, match="was written for sglang"):  # not vLLM's convention
        outputs.resolve_drafter_path(make_cfg(f"drafter.path={tmp_path}/exp/sglang"), "vllm")


# ---------------------------------------------------------------- SmolLM2 and vLLM's own parser


@pytest.mark.slow
def test_smollm2_drafter_export_shapes_and_round_trip(smollm2, make_cfg, tmp_path):
    drafter = randomise(build_drafter(smollm2, make_cfg("target=smollm2-135m").drafter))
    drafter.config.target_num_layers = smollm2.num_layers
    folder = drafter_io.export_sglang(drafter, tmp_path / "smol", RECIPE, dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    assert smollm2.aux_layer_ids == [2, 15, 27] and "eagle_config" not in config
    assert (
        tensors["fc.weight"].shape == (576, 3 * 576)
        and tensors["fc.weight"].dtype == torch.bfloat16
    )
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (
        3 * 64,
        2 * 576,
    )  # 3 kv heads of 64
    assert tensors["lm_head.weight"].shape == (8192, 576) and tensors["t2d"].shape == (49152,)
    assert config["max_position_embeddings"] >= smollm2.config.max_position_embeddings
    loaded = drafter_io.attach_target_embedding(drafter_io.load_drafter(folder), smollm2)
    assert_same_weights(loaded, drafter.to(torch.bfloat16))


@pytest.mark.slow
def test_vllm_parses_our_speculators_config(drafter, tmp_path):
    """vLLM's own speculators parser sees our architecture and HF aux ids."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} missing: run `make vllm`")
    folder = drafter_io.export_speculators(drafter, tmp_path / "spec", RECIPE, speculative_tokens=4)
    script = (
        "import json,sys; from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig as S;"
        "raw=json.load(open(sys.argv[1]+'/config.json')); c=S.extract_transformers_pre_trained_config(raw);"
        "v=S.extract_vllm_speculative_config(raw);"
        "print(json.dumps({k:c.get(k) for k in ('architectures','norm_before_residual',"
        "'eagle_aux_hidden_state_layer_ids','draft_vocab_size','target_hidden_size')}|v))"
    )
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, str(folder)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {
        "architectures": ["Eagle3LlamaForCausalLM"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "draft_vocab_size": 8192,
        "target_hidden_size": 64,
        "method": "eagle3",
        "num_speculative_tokens": 4,
    }


# ---------------------------------------------------------------- the export app


def fake_training_output(cfg, drafter, tau: float):
    """A complete train-stage folder for this config, written with train.py's own format helpers.
    (Only the fit is skipped: training itself is tested in test_train.py.)"""

    out = outputs.train_output(cfg)
    out.start()
    drafter_io.save_drafter_config(drafter, out.path)
    save_file(drafter.trainable_state_dict(), str(out.path / drafter_io.FINAL_WEIGHTS))
    out.finish({"tau_hat": tau, "data_hash": out.upstream["data"], "tokenizer_hash": None})
    return out


def export_cfg(make_cfg, artifacts):
    """The export stage on tiny-llama in a private artifacts folder (own_artifacts: its converted
    targets are the shared ones)."""
    overrides = [
        "target=tiny-llama",
        "train.hidden_states=online",
        f"paths.artifacts={artifacts}",
        "export.speculators=true",
    ]
    return make_cfg(*overrides), overrides


def test_export_run_exports_registers_and_is_idempotent(
    drafter, tiny_target, make_cfg, own_artifacts, shared_mlflow
):
    from mlflow.tracking import MlflowClient

    cfg = make_cfg(*export_cfg(make_cfg, own_artifacts)[1], *shared_mlflow)
    with pytest.raises(Eagle3Error, match=r"run `python -m eagle3.train` first"):
        export.run(cfg)
    trained = fake_training_output(cfg, drafter, tau=3.25)
    out = export.run(cfg)
    assert (
        out.complete
        and out.upstream == {"train": trained.hash}
        and out == outputs.export_output(cfg)
    )
    manifest = out.manifest()
    assert manifest["counts"]["folders"] == ["sglang", "speculators", "vllm"]
    assert manifest["registered"] == "models:/eagle3-tiny-llama/1"
    assert manifest["recipe"]["tau_hat"] == 3.25 and manifest["recipe"]["ttt_length"] == 7
    assert (
        manifest["recipe"]["train_hash"] == trained.hash
        and manifest["recipe"]["data_hash"] == trained.upstream["data"]
    )

    assert outputs.resolve_drafter_path(cfg) == out.path / "sglang"
    assert outputs.resolve_drafter_path(cfg, "vllm") == out.path / "vllm"
    for name, convention in (("sglang", "sglang"), ("vllm", "vllm"), ("speculators", "vllm")):
        loaded = drafter_io.load_drafter(out.path / name, aux_convention=convention)
        assert_same_weights(drafter_io.attach_target_embedding(loaded, tiny_target), drafter)
    tags = MlflowClient(cfg.tracking.uri).get_model_version("eagle3-tiny-llama", "1").tags
    assert tags["tau_hat"] == "3.25" and tags["recipe.train_hash"] == trained.hash

    assert export.run(cfg).hash == out.hash  # complete: a no-op, no second version
    assert (
        len(MlflowClient(cfg.tracking.uri).search_model_versions("name='eagle3-tiny-llama'")) == 1
    )


@pytest.mark.slow
def test_export_app_command_line(drafter, make_cfg, own_artifacts):
    """`python -m eagle3.export`: one-line error without a trained drafter, then export + register."""
    cfg, overrides = export_cfg(make_cfg, own_artifacts)
    command = [
        sys.executable,
        "-m",
        "eagle3.export",
        f"paths.root={cfg.paths.root}",
        *overrides,
        f"tracking.uri={cfg.tracking.uri}",
        f"tracking.artifact_location={cfg.tracking.artifact_location}",
    ]
    missing = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert (
        missing.returncode == 1
        and "run `python -m eagle3.train` first" in missing.stderr.strip().splitlines()[-1]
    )
    fake_training_output(cfg, drafter, tau=3.25)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = outputs.export_output(cfg)
    assert (
        f"exported drafter: {out.path}" in done.stdout
        and "registered: models:/eagle3-tiny-llama/1" in done.stdout
    )


def test_registry_name_follows_the_target(make_cfg):
    def name(*overrides):
        cfg = make_cfg(*overrides)
        return export.registry_name(cfg.export, cfg.target)

    assert name("target=tiny-llama") == "eagle3-tiny-llama"
    assert (
        name("target=hf", "target.path=meta-llama/Llama-3.1-8B-Instruct")
        == "eagle3-Llama-3.1-8B-Instruct"
    )
    assert name("export.registry_name=mine") == "mine"


# Runs SGLang's own LlamaForCausalLM.set_eagle3_layers_to_capture (lifted out of the installed
# source: the parser-only venv cannot import the model module) on a folder's eagle_config ids.
SGLANG_CAPTURE = """
import ast, json, sys, typing
from types import SimpleNamespace as NS
import sglang, pathlib
source = (pathlib.Path(sglang.__file__).parent / "srt/models/llama.py").read_text()
cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLM")
fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture")
scope = {"Optional": typing.Optional, "List": typing.List}
exec(compile(ast.Module([fn], []), "llama.py", "exec"), scope)
config = json.load(open(sys.argv[1] + "/config.json"))
me = NS(pp_group=NS(is_last_rank=True), model=NS(), config=NS(num_hidden_layers=int(sys.argv[2])))
scope["set_eagle3_layers_to_capture"](me, (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
print(json.dumps(me.model.layers_to_capture))
"""

# vLLM's own reading of the draft config (the ids are then matched against decoder layer indices
# whose *inputs* are captured, i.e. HF hidden_states[i]).
VLLM_CAPTURE = """
import json, sys
from types import SimpleNamespace as NS
from transformers import AutoConfig
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
spec = NS(draft_model_config=NS(hf_config=AutoConfig.from_pretrained(sys.argv[1])))
default = [2, int(sys.argv[2]) // 2, int(sys.argv[2]) - 3]
for ids in (get_eagle3_aux_layers_from_config(spec),  # the newer GPU runner
            GPUModelRunner._get_eagle3_aux_layers_from_config(NS(speculative_config=spec))):  # CPU + legacy GPU
    print(json.dumps(list(ids) if ids else default))
"""


@pytest.mark.slow
@pytest.mark.parametrize("aux_ids, num_layers", [([1, 2, 3], 4), ([2, 15, 27], 30)])
def test_engines_own_code_captures_our_aux_layers(drafter, tmp_path, aux_ids, num_layers):
    """Each engine, reading the folder written for it, captures exactly the HF hidden_states we trained on."""
    for python in (SGLANG_PYTHON, VLLM_PYTHON):
        if not python.exists():
            pytest.fail(f"{python} missing: run `make setup`")
    drafter.config.aux_layer_ids, drafter.config.target_num_layers = aux_ids, num_layers
    for engine, python, script in (
        ("sglang", SGLANG_PYTHON, SGLANG_CAPTURE),
        ("vllm", VLLM_PYTHON, VLLM_CAPTURE),
    ):
        folder = drafter_io.export_sglang(drafter, tmp_path / engine, RECIPE, engine=engine)
        out = subprocess.run(
            [str(python), "-c", script, str(folder), str(num_layers)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        captured = [
            json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("[")
        ]
        assert captured == [aux_ids] * (2 if engine == "vllm" else 1), engine


def test_a_drafter_cut_short_is_refused_before_an_engine_starts(
    drafter, make_cfg, own_artifacts, tmp_path
):
    """An exported model.safetensors cut short: drafter_for (what serve and bench call before
    starting an engine) names the file, from the export's manifest; a copy of the folder outside
    any export is refused by the file's own safetensors header."""
    from eagle3.core.spec import resolve_spec
    from eagle3.serve.app import drafter_for

    cfg, overrides = export_cfg(make_cfg, own_artifacts)
    fake_training_output(cfg, drafter, tau=2.0)
    out = export.run(cfg)
    spec = resolve_spec(make_cfg(*overrides, "spec=d10s5").spec)
    weights = out.path / "sglang" / "model.safetensors"
    assert drafter_for(cfg, spec) == weights.parent
    whole = weights.read_bytes()
    loose = tmp_path / "drafter"
    shutil.copytree(weights.parent, loose)
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(Eagle3Error) as err:
        drafter_for(cfg, spec)
    assert str(err.value).startswith(f"{weights} has {len(whole) // 2:,} bytes where its header")
    (loose / "model.safetensors").write_bytes(whole[:-1])
    with pytest.raises(Eagle3Error) as err:
        drafter_for(make_cfg(*overrides, f"drafter.path={loose}"), spec)
    assert str(err.value) == (
        f"{loose / 'model.safetensors'} has {len(whole) - 1:,} bytes where its header promises "
        f"{len(whole):,}: the file was cut short; copy or export it again"
    )
    weights.write_bytes(whole)
    (out.path / "sglang" / "config.json").write_text("{}\n" + " " * 10)
    with pytest.raises(Eagle3Error, match=r"config.json has .* bytes where its manifest says"):
        drafter_for(cfg, spec)

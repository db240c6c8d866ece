"""Every on-disk form of an EAGLE-3 drafter: the SGLang / vLLM folder, the speculators folder,
published drafters (SGLang, SpecForge, EAGLE, speculators), `models:/` registry URIs and the
training stage's own weights. Every stage may import it; it imports no stage.

SGLang / vLLM folder: `config.json` (architectures LlamaForCausalLMEagle3) + `model.safetensors`
with `fc.weight`, `midlayer.*` (one layer) or `layers.{i}.*`, `norm.weight`, `lm_head.weight`,
`d2t` (int64), `t2d` (bool). Engines silently drop unknown keys and keep random weights for
missing ones (symptom: acceptance 1.00), so every key, shape and dtype is checked before a
byte is written, and again on import.

Aux layer ids mean different things in the two engines. Both capture HF `hidden_states[i]`
for i in [2, L//2, L-3] by default; an explicit `eagle_config.eagle_aux_hidden_state_layer_ids`
is used as written by vLLM (HF indices) but SGLang adds 1 to each id (it wants layer-output
ids). So default layers are written as no ids at all, custom ones in each engine's own
convention, and our unambiguous HF indices always go in the recipe under `eagle3`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from eagle3.core.artifacts import load_safetensors, read_json
from eagle3.core.common import Eagle3Error, log, resolve_device
from eagle3.core.config import plain
from eagle3.core.drafter import Eagle3Drafter
from eagle3.core.target import Target, default_aux_layer_ids
from eagle3.core.target import tokenizer_hash as hash_of

ARCHITECTURE = "LlamaForCausalLMEagle3"


RECIPE_KEY = "eagle3"  # our namespaced key in config.json: HF aux ids, recipe, engine convention


ENGINES = ("sglang", "vllm")


WEIGHTS_FILE = "model.safetensors"


MODELS_URI = "models:/"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Architecture variants some published drafters use that our module does not implement.
UNSUPPORTED_FLAGS = (
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
)


def layer_prefixes(num_layers: int, style: str) -> list[str]:
    """`midlayer` for a single layer in the engines' layout (both load it), else `layers.{i}`."""
    if style in ENGINES and num_layers == 1:
        return ["midlayer"]
    return [f"layers.{i}" for i in range(num_layers)]


def later_norm(style: str) -> str:
    """The pre-attention norm of layers after the first. SGLang names it hidden_norm (fusing the
    residual add into it), vLLM and this module input_layernorm; the function is the same."""
    return "hidden_norm" if style == "sglang" else "input_layernorm"


def expected_shapes(
    config: LlamaConfig, style: str, include_embedding: bool = False
) -> dict[str, tuple]:
    """Every tensor an engine folder must hold: name -> (shape, dtype or None for any float)."""
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    head_dim, inter = config.head_dim, config.intermediate_size
    shapes: dict[str, tuple] = {"fc.weight": ((hidden, 3 * config.target_hidden_size), None)}
    for index, prefix in enumerate(layer_prefixes(config.num_hidden_layers, style)):
        attn_in = 2 * hidden if index == 0 else hidden
        shapes.update(
            {
                f"{prefix}.self_attn.q_proj.weight": ((heads * head_dim, attn_in), None),
                f"{prefix}.self_attn.k_proj.weight": ((kv_heads * head_dim, attn_in), None),
                f"{prefix}.self_attn.v_proj.weight": ((kv_heads * head_dim, attn_in), None),
                f"{prefix}.self_attn.o_proj.weight": ((hidden, heads * head_dim), None),
                f"{prefix}.mlp.gate_proj.weight": ((inter, hidden), None),
                f"{prefix}.mlp.up_proj.weight": ((inter, hidden), None),
                f"{prefix}.mlp.down_proj.weight": ((hidden, inter), None),
                f"{prefix}.post_attention_layernorm.weight": ((hidden,), None),
            }
        )
        norms = ["input_layernorm", "hidden_norm"] if index == 0 else [later_norm(style)]
        shapes.update({f"{prefix}.{norm}.weight": ((hidden,), None) for norm in norms})
    shapes.update(
        {
            "norm.weight": ((hidden,), None),
            "lm_head.weight": ((config.draft_vocab_size, hidden), None),
            "d2t": ((config.draft_vocab_size,), torch.int64),
            "t2d": ((config.vocab_size,), torch.bool),
        }
    )
    if include_embedding:
        shapes["embed_tokens.weight"] = ((config.vocab_size, hidden), None)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], where: str) -> None:
    """Raise one Eagle3Error listing every missing, unexpected, misshaped or mistyped tensor."""
    problems = [
        f"missing {name} {list(shape)}"
        for name, (shape, _) in expected.items()
        if name not in tensors
    ]
    problems += [
        f"unexpected {name} {list(t.shape)}" for name, t in tensors.items() if name not in expected
    ]
    for name, tensor in tensors.items():
        if name not in expected:
            continue
        shape, dtype = expected[name]
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
        if dtype is not None and tensor.dtype != dtype:
            problems.append(f"{name} has dtype {tensor.dtype}, expected {dtype}")
        if dtype is None and not tensor.is_floating_point():
            problems.append(f"{name} has dtype {tensor.dtype}, expected a float dtype")
    if problems:
        raise Eagle3Error(
            f"{where}: {len(problems)} key/shape problem(s), nothing written/loaded: "
            + "; ".join(problems)
        )


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t and t2d must describe the same draft vocab (draft id d -> target id d + d2t[d])."""
    target_ids = torch.arange(len(d2t)) + d2t.cpu()
    if target_ids.min() < 0 or target_ids.max() >= len(t2d):
        raise Eagle3Error(f"{where}: d2t maps draft ids outside the target vocab of {len(t2d)}")
    if (
        len(set(target_ids.tolist())) != len(d2t)
        or int(t2d.sum()) != len(d2t)
        or not t2d.cpu()[target_ids].all()
    ):
        raise Eagle3Error(
            f"{where}: d2t and t2d disagree (was the vocab map set? draft vocab {len(d2t)}, "
            f"t2d marks {int(t2d.sum())} tokens)"
        )


def engine_tensors(
    drafter: Eagle3Drafter,
    style: str,
    dtype: torch.dtype | None = None,
    include_embedding: bool = False,
) -> dict[str, torch.Tensor]:
    """The drafter's weights under the engine's names (`layers.0.` -> `midlayer.` for one layer)."""
    state = drafter.state_dict() if include_embedding else drafter.trainable_state_dict()
    prefixes = layer_prefixes(drafter.config.num_hidden_layers, style)
    tensors = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if match:
            index, rest = int(match.group(1)), match.group(2)
            if index > 0 and rest == "input_layernorm.weight":
                rest = f"{later_norm(style)}.weight"
            name = f"{prefixes[index]}.{rest}"
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous().clone()
    return tensors


def llama_fields(config: LlamaConfig, dtype: torch.dtype) -> dict:
    """The Llama fields engines read from a drafter config (rope_theta top-level for transformers 4)."""
    rope = dict(config.rope_parameters or {})
    fields = {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return fields


def engine_aux_ids(hf_ids: list[int], engine: str) -> list[int]:
    """Our HF `hidden_states` indices in an engine's convention (SGLang adds 1 when reading them)."""
    if engine not in ENGINES:
        raise Eagle3Error(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    return [i - 1 for i in hf_ids] if engine == "sglang" else list(hf_ids)


def hf_aux_ids(engine_ids: list[int], engine: str) -> list[int]:
    return [i + 1 for i in engine_ids] if engine == "sglang" else list(engine_ids)


def is_default_aux(hf_ids: list[int] | None, target_num_layers: int | None) -> bool:
    if hf_ids is None:
        return True
    return target_num_layers is not None and list(hf_ids) == default_aux_layer_ids(
        target_num_layers
    )


def recipe_block(drafter: Eagle3Drafter, recipe: dict, engine: str) -> dict:
    config = drafter.config
    return {
        "aux_layer_ids_hf": list(config.aux_layer_ids)
        if config.aux_layer_ids is not None
        else None,
        "target_num_layers": getattr(config, "target_num_layers", None),
        "aux_convention": engine,
        "recipe": plain(recipe),
    }


def sglang_config(drafter: Eagle3Drafter, recipe: dict, engine: str, dtype: torch.dtype) -> dict:
    config = drafter.config
    out = {
        "architectures": [ARCHITECTURE],
        **llama_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
    }
    hf_ids = config.aux_layer_ids
    if not is_default_aux(hf_ids, getattr(config, "target_num_layers", None)):
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": engine_aux_ids(hf_ids, engine)}
        if (
            engine == "vllm"
        ):  # vLLM's newer GPU runner reads only the top-level key (or eagle_config.layer_ids)
            out["eagle_aux_hidden_state_layer_ids"] = engine_aux_ids(hf_ids, engine)
    out[RECIPE_KEY] = recipe_block(drafter, recipe, engine)
    return out


def speculators_config(
    drafter: Eagle3Drafter, recipe: dict, dtype: torch.dtype, speculative_tokens: int, verifier: str
) -> dict:
    """vLLM's speculators format: layer config nested, our norm placement spelled out
    (its default is norm_before_residual=true, which is not this architecture)."""
    config = drafter.config
    layer_config = {"architectures": ["LlamaForCausalLM"], **llama_fields(config, dtype)}
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
            ],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": layer_config["torch_dtype"],
    }
    hf_ids = config.aux_layer_ids
    if not is_default_aux(hf_ids, getattr(config, "target_num_layers", None)):
        out["eagle_aux_hidden_state_layer_ids"] = engine_aux_ids(hf_ids, "vllm")
    out[RECIPE_KEY] = recipe_block(drafter, recipe, "vllm")
    return out


def write_folder(
    tensors: dict[str, torch.Tensor], config: dict, expected: dict, out_dir: Path
) -> Path:
    """Check, then write config.json + model.safetensors into out_dir (atomically replaced)."""
    out_dir = Path(out_dir)
    check_tensors(tensors, expected, f"refusing to write {out_dir}")
    check_vocab_map(tensors["d2t"], tensors["t2d"], f"refusing to write {out_dir}")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir


def resolve_export_dtype(name: str | None, drafter: Eagle3Drafter) -> torch.dtype:
    if name is None:
        return drafter.fc.weight.dtype
    if name not in DTYPES:
        raise Eagle3Error(f"export.dtype={name!r}: use null, {', '.join(DTYPES)}")
    return DTYPES[name]


def export_sglang(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    recipe: dict,
    engine: str = "sglang",
    dtype: str | None = None,
    include_embedding: bool = False,
) -> Path:
    """The SGLang folder; engine="vllm": the same folder with custom aux ids in vLLM's convention
    (and, for several layers, vLLM's norm names)."""
    torch_dtype = resolve_export_dtype(dtype, drafter)
    if engine == "sglang" and drafter.config.num_hidden_layers != 1:
        log.warning(
            "SGLang releases before multi-layer EAGLE-3 support refuse this %d-layer drafter",
            drafter.config.num_hidden_layers,
        )
    tensors = engine_tensors(drafter, engine, torch_dtype, include_embedding)
    config = sglang_config(drafter, recipe, engine, torch_dtype)
    return write_folder(
        tensors, config, expected_shapes(drafter.config, engine, include_embedding), Path(out_dir)
    )


def export_speculators(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    recipe: dict,
    speculative_tokens: int = 3,
    dtype: str | None = None,
    include_embedding: bool = False,
    verifier: str = "",
) -> Path:
    """The speculators-format folder (`layers.{i}.*`, speculators config) that vLLM also loads."""
    torch_dtype = resolve_export_dtype(dtype, drafter)
    tensors = engine_tensors(drafter, "speculators", torch_dtype, include_embedding)
    config = speculators_config(drafter, recipe, torch_dtype, speculative_tokens, verifier)
    return write_folder(
        tensors,
        config,
        expected_shapes(drafter.config, "speculators", include_embedding),
        Path(out_dir),
    )


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter folder: safetensors (single or sharded) or a torch .bin (tensors only)."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        tensors = {}
        for file in files:
            tensors.update(load_safetensors(file))
        return tensors
    bins = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if bins:
        tensors = {}
        for file in bins:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        return tensors
    raise Eagle3Error(f"{folder} has no *.safetensors or *.bin weights")


def split_stacked(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """qkv_proj / gate_up_proj (stacked projections) -> our separate q/k/v and gate/up."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        q, k, v = torch.split(tensor, [q_rows, kv_rows, kv_rows], dim=0)
        base = name.removesuffix("qkv_proj.weight")
        return {base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v}
    if name.endswith("mlp.gate_up_proj.weight"):
        gate, up = tensor.chunk(2, dim=0)
        base = name.removesuffix("gate_up_proj.weight")
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    return {name: tensor}


def normalise_names(
    tensors: dict[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """SGLang / SpecForge / EAGLE / speculators names -> ours (`midlayer.` -> `layers.0.`, no `model.`)."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        match = re.fullmatch(r"layers\.(\d+)\.hidden_norm\.weight", name)
        if match and int(match.group(1)) > 0:  # SGLang's name for a later layer's input norm
            name = f"layers.{match.group(1)}.input_layernorm.weight"
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a derived buffer some checkpoints carry
        out.update(split_stacked(name, tensor, config))
    return out


def layer_config_dict(raw: dict) -> dict:
    """The Llama fields of a drafter config.json (speculators nests them)."""
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise Eagle3Error(
                f"speculators model type {raw['speculators_model_type']!r} is not eagle3"
            )
        return {
            **raw.get("transformer_layer_config", {}),
            **{
                k: raw[k]
                for k in ("draft_vocab_size", "target_hidden_size", *UNSUPPORTED_FLAGS)
                if k in raw
            },
        }
    return raw


def check_supported(fields: dict, folder: Path, speculators: bool) -> None:
    flags = {flag: fields.get(flag, False) for flag in UNSUPPORTED_FLAGS}
    if speculators and "norm_before_residual" not in fields:
        flags["norm_before_residual"] = True  # vLLM's default for speculators folders
    enabled = [flag for flag, value in flags.items() if value]
    if enabled:
        raise Eagle3Error(
            f"{folder}: drafter variant with {', '.join(enabled)} is not supported by this "
            "EAGLE-3 module (it would load but predict wrongly)"
        )


def folder_aux_ids(raw: dict, aux_convention: str) -> list[int] | None:
    """HF aux ids of a folder: ours from the recipe; else the engine ids converted; None = engine default."""
    if raw.get(RECIPE_KEY, {}).get("aux_layer_ids_hf") is not None:
        return list(raw[RECIPE_KEY]["aux_layer_ids_hf"])
    if "speculators_model_type" in raw:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return hf_aux_ids(ids, "vllm") if ids else None
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return hf_aux_ids(ids, aux_convention) if ids else None


def drafter_config_from(raw: dict, folder: Path, aux_convention: str) -> LlamaConfig:
    fields = layer_config_dict(raw)
    check_supported(fields, folder, "speculators_model_type" in raw)
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = LlamaConfig(
        **{k: fields[k] for k in keep if fields.get(k) is not None}, tie_word_embeddings=False
    )
    config.draft_vocab_size = fields.get("draft_vocab_size") or config.vocab_size
    config.target_hidden_size = fields.get("target_hidden_size") or config.hidden_size
    config.aux_layer_ids = folder_aux_ids(raw, aux_convention)
    block = raw.get(RECIPE_KEY, {})
    config.target_num_layers = block.get("target_num_layers")
    config.recipe = block.get("recipe", {})
    config.source = str(folder)
    return config


def identity_vocab_map(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Published drafters over the full vocab ship no map: draft id == target id."""
    return {
        "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
        "t2d": torch.ones(config.vocab_size, dtype=torch.bool),
    }


def load_drafter(
    path_or_uri: str | Path,
    device: str | torch.device | None = None,
    aux_convention: str = "sglang",
    tracking_uri: str | None = None,
) -> Eagle3Drafter:
    """Load a drafter folder (ours, SGLang, SpecForge, EAGLE, speculators), a whole export (its
    aux_convention subfolder) or a `models:/name/version` URI. aux_convention: how to read an
    explicit eagle_config.eagle_aux_hidden_state_layer_ids in a folder without our recipe
    (SGLang's layer-output ids or vLLM's HF indices). Without embed_tokens in the folder, call
    attach_target_embedding before use."""
    folder = (
        Path(path_or_uri)
        if not str(path_or_uri).startswith(MODELS_URI)
        else download_registered(str(path_or_uri), tracking_uri)
    )
    folder = engine_folder(folder, aux_convention)
    raw = read_drafter_config(folder)
    config = drafter_config_from(raw, folder, aux_convention)
    tensors = normalise_names(read_weights(folder), config)
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors.update(identity_vocab_map(config))
    has_embedding = "embed_tokens.weight" in tensors
    check_tensors(
        tensors, expected_shapes(config, "ours", has_embedding), f"cannot import {folder}"
    )
    check_vocab_map(tensors["d2t"], tensors["t2d"], f"cannot import {folder}")
    drafter = Eagle3Drafter(config).to(tensors["fc.weight"].dtype)
    missing, _ = drafter.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"embed_tokens.weight"}, missing  # check_tensors covered the rest
    drafter.config.has_embedding = has_embedding
    return drafter.to(resolve_device(str(device)) if device else torch.device("cpu"))


def attach_target_embedding(drafter: Eagle3Drafter, target) -> Eagle3Drafter:
    """Copy the target's (frozen) input embedding into the drafter and fill in default aux ids."""
    check_drafter_for_target(drafter, target)
    weight = target.input_embedding().data
    drafter.embed_tokens.weight.data.copy_(weight.to(drafter.embed_tokens.weight.dtype))
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.config.has_embedding = True
    return drafter


def check_folder_for_target(
    folder: Path, target_config: dict, target_path, aux_layer_ids, tokenizer_of, aux_convention: str
) -> None:
    """check_drafter_for_target from the two folders' config.json alone (no weights loaded): hidden
    size, vocab, positions, aux layers and, when the drafter records it, the tokenizer (tokenizer_of()
    loads the target's). What a bench checks before it measures spec=off or starts an engine."""
    config = drafter_config_from(read_drafter_config(folder), folder, aux_convention)
    layers = int(target_config["num_hidden_layers"])
    positions = target_config.get("max_position_embeddings") or config.max_position_embeddings
    target = SimpleNamespace(
        hidden_size=target_config.get("hidden_size"),
        vocab_size=target_config.get("vocab_size"),
        config=SimpleNamespace(max_position_embeddings=positions),
        aux_layer_ids=list(aux_layer_ids or default_aux_layer_ids(layers)),
        num_layers=layers,
        path=target_path,
    )
    trained_with = (getattr(config, "recipe", None) or {}).get("tokenizer_hash")
    tokenizer_hash = hash_of(tokenizer_of()) if trained_with else None
    check_drafter_for_target(SimpleNamespace(config=config), target, tokenizer_hash)


def read_drafter_config(folder: Path) -> dict:
    """A drafter folder's config.json, or one line naming it when it is cut short or not JSON."""
    path = Path(folder) / "config.json"
    raw = read_json(path, "export or copy the drafter again")
    if not isinstance(raw, dict):
        raise Eagle3Error(f"{path} holds a JSON {type(raw).__name__}, not a drafter config object")
    return raw


def check_drafter_for_target(
    drafter: Eagle3Drafter, target, tokenizer_hash: str | None = None
) -> None:
    """Raise Eagle3Error when the drafter cannot draft for this target: hidden size, vocab,
    aux layers, or a vocab map built with another tokenizer. Fills in engine-default aux ids."""
    config, problems = drafter.config, []
    if config.target_hidden_size != target.hidden_size:
        problems.append(
            f"drafter expects target hidden size {config.target_hidden_size}, target has "
            f"{target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        problems.append(f"drafter vocab {config.vocab_size} != target vocab {target.vocab_size}")
    if config.max_position_embeddings < target.config.max_position_embeddings:
        problems.append(
            f"drafter max_position_embeddings {config.max_position_embeddings} < the target's "
            f"{target.config.max_position_embeddings}"
        )
    if config.aux_layer_ids is None:
        config.aux_layer_ids = default_aux_layer_ids(target.num_layers)
    if list(config.aux_layer_ids) != list(target.aux_layer_ids):
        problems.append(
            f"drafter was trained on aux layers {list(config.aux_layer_ids)} (HF hidden_states "
            f"indices), target captures {list(target.aux_layer_ids)} (set target.aux_layer_ids)"
        )
    trained_with = (getattr(config, "recipe", None) or {}).get("tokenizer_hash")
    if trained_with and tokenizer_hash is None:
        tokenizer_hash = hash_of(target.tokenizer)
    if trained_with and tokenizer_hash != trained_with:
        problems.append(
            f"vocab map built with tokenizer {trained_with}, target tokenizer is {tokenizer_hash}"
        )
    if problems:
        raise Eagle3Error(
            f"drafter {getattr(config, 'source', '')} does not fit target {target.path}: "
            + "; ".join(problems)
        )
    config.target_num_layers = target.num_layers


def parse_models_uri(uri: str) -> tuple[str, str]:
    parts = uri.removeprefix(MODELS_URI).strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        raise Eagle3Error(f"drafter.path={uri}: expected models:/NAME/VERSION")
    return parts[0], parts[1]


def download_registered(uri: str, tracking_uri: str | None = None, dst: Path | None = None) -> Path:
    """A local copy of a registered drafter (`models:/name/version`, version may be `latest`)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name, version = parse_models_uri(uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        if version == "latest":
            version = max(
                (v.version for v in client.search_model_versions(f"name='{name}'")), key=int
            )
        source = client.get_model_version(name, version).source
    except (MlflowException, ValueError) as err:
        raise Eagle3Error(
            f"{uri} is not in the model registry at {client.tracking_uri} ({err})"
        ) from None
    if dst is None:
        return Path(
            mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=tracking_uri)
        )
    if dst.exists():  # downloaded before (versions are immutable)
        return next(dst.iterdir())
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mlflow.artifacts.download_artifacts(
        artifact_uri=source, dst_path=str(partial), tracking_uri=tracking_uri
    )
    partial.rename(dst)
    return next(dst.iterdir())


def engine_folder(folder: Path, engine: str) -> Path:
    """A drafter folder itself, or its engine subfolder when it is a whole export."""
    if (folder / "config.json").exists():
        return folder
    for name in (engine, "sglang", "speculators"):
        if (folder / name / "config.json").exists():
            return folder / name
    raise Eagle3Error(f"{folder} holds no drafter (no config.json, nor {engine}/config.json)")


# The training stage's folder: Lightning checkpoints, final and best weights, the drafter config.
CHECKPOINTS = "checkpoints"
FINAL_WEIGHTS, BEST_WEIGHTS, DRAFTER_CONFIG = (
    "drafter.safetensors",
    "best.safetensors",
    "drafter_config.json",
)


def drafter_weights(checkpoint_path: Path) -> dict[str, torch.Tensor]:
    """The drafter's trainable tensors (and vocab map) out of a Lightning checkpoint."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)["state_dict"]
    prefix = "drafter."
    return {k[len(prefix) :]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}


def save_drafter_config(drafter: Eagle3Drafter, folder: Path) -> None:
    (folder / DRAFTER_CONFIG).write_text(json.dumps(drafter.config.to_dict(), indent=2))


def load_trained_drafter(
    train_dir: str | Path, target: Target, which: str = "best"
) -> Eagle3Drafter:
    """A drafter trained by this stage (`which`: best = best val tau_hat, final = last weights),
    its frozen embedding copied from `target`."""
    train_dir = Path(train_dir)
    weights = train_dir / (BEST_WEIGHTS if which == "best" else FINAL_WEIGHTS)
    if which == "best" and not weights.exists():
        weights = train_dir / FINAL_WEIGHTS
    if not weights.exists() or not (train_dir / DRAFTER_CONFIG).exists():
        raise Eagle3Error(
            f"{train_dir} holds no trained drafter ({weights.name}, {DRAFTER_CONFIG}): "
            "run `python -m eagle3.train`"
        )
    config = LlamaConfig.from_dict(
        read_json(train_dir / DRAFTER_CONFIG, "rerun `python -m eagle3.train` for that folder")
    )
    drafter = Eagle3Drafter(config)
    missing, unexpected = drafter.load_state_dict(load_safetensors(weights), strict=False)
    missing = [
        k for k in missing if not k.startswith("embed_tokens.")
    ]  # the embedding is the target's
    if missing or unexpected:
        raise Eagle3Error(
            f"{weights} does not fit the drafter in {DRAFTER_CONFIG}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    drafter.embed_tokens.weight.data.copy_(target.input_embedding().data.float())
    return drafter.to(target.device)

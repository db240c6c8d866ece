"""The few tensors of a target that offline training and export need: its input embedding, its
output head (lm_head) and its final norm, read by name from the safetensors files (through
model.safetensors.index.json when sharded), never the decoder layers. A 1T-parameter target's
head and embedding are a few GB; the whole target does not fit one host process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from eagle3.core.common import Eagle3Error, resolve_dtype
from eagle3.core.config import TargetConfig
from eagle3.core.target import (
    TargetShape,
    default_aux_layer_ids,
    folder_text_config,
    target_folder,
    target_tokenizer,
)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class TargetParts(TargetShape):
    """Duck-types eagle3.core.target.Target for everything but running the model."""

    config: PretrainedConfig
    tokenizer: object
    path: Path
    aux_layer_ids: list[int]
    embedding: torch.Tensor  # [vocab, H]
    head: torch.Tensor  # [vocab, H]; the embedding itself when the target ties them
    norm: torch.Tensor  # [H], the final norm's weight

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def input_embedding(self) -> torch.Tensor:
        return self.embedding

    def output_embedding(self) -> torch.Tensor:
        return self.head


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> the file that holds it (read from the index; a single file is listed)."""
    if (folder / INDEX).exists():
        return json.loads((folder / INDEX).read_text())["weight_map"]
    if (folder / SINGLE).exists():
        with safe_open(str(folder / SINGLE), "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise Eagle3Error(f"target {folder} has no {INDEX} nor {SINGLE}: not a safetensors folder")


def top_level(names: list[str], suffix: str) -> str | None:
    """The one tensor named *suffix outside the decoder layers (DeepSeek-V3's MTP layer carries
    its own embed_tokens and head under model.layers.61)."""
    found = [n for n in names if n.endswith(suffix) and ".layers." not in n]
    return min(found, key=len) if found else None


def part_names(names: list[str], tied: bool) -> dict[str, str]:
    """The names of the embedding, head and final norm (Llama / DeepSeek-V3 `model.*`, Kimi-K2.5's
    `language_model.model.*`)."""
    embedding = top_level(names, "embed_tokens.weight")
    if embedding is None:
        raise Eagle3Error("the target's weights hold no *.embed_tokens.weight outside its layers")
    prefix = embedding.removesuffix("embed_tokens.weight")
    head = top_level(names, "lm_head.weight") or (embedding if tied else None)
    if head is None:
        raise Eagle3Error("the target's weights hold no lm_head.weight and it does not tie it")
    return {"embedding": embedding, "head": head, "norm": prefix + "norm.weight"}


def read_tensors(folder: Path, wanted: dict[str, str], files: dict[str, str], dtype) -> dict:
    """{part: tensor} for {part: name}, opening only the files that hold them."""
    tensors = {}
    for part, name in wanted.items():
        if name not in files:
            raise Eagle3Error(f"target {folder}: no tensor {name} in its safetensors files")
        with safe_open(str(folder / files[name]), "pt") as f:
            tensors[part] = f.get_tensor(name).to(dtype)
    return tensors


def load_target_parts(tcfg: TargetConfig, artifacts: Path | str) -> TargetParts:
    """The target's tokenizer, config, embedding, head and final norm, on the CPU in the dtype
    load_target would use there (artifacts: paths.artifacts, where converted targets live)."""
    path = target_folder(tcfg, Path(artifacts))
    config = PretrainedConfig(**folder_text_config(path))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    dtype = resolve_dtype(tcfg.dtype, torch.device("cpu"))
    names = part_names(list(weight_map(path)), tied)
    tensors = read_tensors(path, names, weight_map(path), dtype)
    layers = config.num_hidden_layers
    aux = list(tcfg.aux_layer_ids) if tcfg.aux_layer_ids else default_aux_layer_ids(layers)
    # the tokenizer as every stage loads it (target.trust_remote_code: Kimi's tiktoken class)
    return TargetParts(config, target_tokenizer(path, tcfg), path, aux, **tensors)

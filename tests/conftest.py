"""Shared fixtures: an artifacts root per test process (xdist worker); targets are shared."""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from eagle3.core.common import compose
from eagle3.core.config import DrafterConfig

# Converted targets are cached here across runs so local reruns skip the GGUF conversion.
TEST_ROOT = Path(os.environ.get("EAGLE3_TEST_ROOT", "/tmp/eagle3-tests"))
# What pytest-xdist workers share: each builds these under a folder lock, once per test root.
SHARED = ("artifacts/targets", "drafters")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)  # one thread per worker: two workers fill the two cores


@pytest.fixture(scope="session")
def test_root() -> Path:
    """The artifacts root of this test process. A pytest-xdist worker gets its own (stage outputs
    and run folders of one config are written by one process) linking the SHARED folders."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = TEST_ROOT / "workers" / worker if worker else TEST_ROOT
    root.mkdir(parents=True, exist_ok=True)
    if worker:
        for shared in SHARED:
            (TEST_ROOT / shared).mkdir(parents=True, exist_ok=True)
            link = root / shared
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(TEST_ROOT / shared)
    return root


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path | None:
    """A new MLflow sqlite store, made once: creating one runs MLflow's schema migrations (seconds
    each time); a copy of it is the same new store. None where MLflow is not installed (a GPU
    machine running the tests from a bundle): runs are then not tracked."""
    if importlib.util.find_spec("mlflow") is None:
        return None
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("empty-store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def make_cfg(test_root, tmp_path, empty_store):
    """Compose the primary config with overrides; artifacts shared, a new mlruns store per test."""
    store = tmp_path / "mlruns" / "mlflow.db"

    def make(*overrides: str):
        if empty_store is None:
            return compose([f"paths.root={test_root}", "tracking.enabled=false", *overrides])
        if not store.exists():
            store.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(empty_store, store)
        return compose(
            [
                f"paths.root={test_root}",
                f"tracking.uri=sqlite:///{store}",
                f"tracking.artifact_location={tmp_path}/mlruns/artifacts",
                *overrides,
            ]
        )

    return make


@pytest.fixture
def own_artifacts(test_root, tmp_path):
    """A private artifacts folder (for tests that write or damage stage outputs) sharing the converted targets."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shared = test_root / "artifacts" / "targets"
    shared.mkdir(parents=True, exist_ok=True)  # a test run alone would otherwise link to nothing
    (artifacts / "targets").symlink_to(shared)
    return artifacts


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: torch's thread pool spinning against other processes costs 8x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target(test_root):
    from eagle3.core.target import load_target

    cfg = compose([f"paths.root={test_root}", "target=tiny-llama"])
    return load_target(cfg.target, cfg.paths.artifacts)


@pytest.fixture(scope="session")
def tiny_fitted_drafter(tiny_target, test_root):
    """A drafter fitted to tiny-llama's greedy rollouts (engine_helpers.fitted_drafter), made once."""
    from engine_helpers import fitted_drafter

    cfg = compose([f"paths.root={test_root}", "target=tiny-llama"])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fitted_drafter(tiny_target, cfg.drafter, rollout_tokens=64, steps=60)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_drafter(test_root):
    """An untrained tiny-llama drafter, exported (support.export_untrained_drafter), made once."""
    from support import export_untrained_drafter

    cfg = compose([f"paths.root={test_root}", "target=tiny-llama"])
    return export_untrained_drafter(cfg, test_root / "drafters" / "tiny-untrained")


@pytest.fixture(scope="session")
def smollm2(test_root):
    from eagle3.core.target import load_target

    cfg = compose([f"paths.root={test_root}", "target=smollm2-135m", "target.dtype=float32"])
    return load_target(cfg.target, cfg.paths.artifacts)


@pytest.fixture(scope="session")
def smollm2_trained_drafter(test_root):
    """The exported SmolLM2 drafter trained by eagle3.train (engine_helpers.trained_smollm2_drafter)."""
    from engine_helpers import trained_smollm2_drafter

    return trained_smollm2_drafter(test_root)


@dataclass
class SixTokenCase:
    """A random 2-layer target over a 6-token vocabulary, an untrained drafter for it, and the exact
    joint distribution of the first `length` tokens sampled after `prompt` at `temperature`,
    computed by brute force over all 6**length sequences (index a * 6 + b for length 2)."""

    target: object
    drafter: torch.nn.Module
    prompt: list[int]
    temperature: float
    length: int
    exact: torch.Tensor


@pytest.fixture(scope="module")
def six_token_case() -> SixTokenCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.core.drafter import build_drafter
    from eagle3.core.target import Target

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    target = Target(LlamaForCausalLM(config).eval().requires_grad_(False), None, None, [0, 1, 1])
    drafter = build_drafter(target, DrafterConfig(num_layers=1, draft_vocab_size=6))
    prompt, temperature, length = [1, 2], 1.5, 2
    with torch.no_grad():
        sequences = torch.cartesian_prod(*[torch.arange(6)] * length).tolist()
        ids = torch.tensor([[*prompt, *seq] for seq in sequences])
        logits = target.model(ids).logits[:, len(prompt) - 1 : -1].double()
        probs = torch.softmax(logits / temperature, dim=-1)
        exact = probs.gather(-1, ids[:, len(prompt) :, None])[..., 0].prod(dim=-1)
    return SixTokenCase(target, drafter.eval(), prompt, temperature, length, exact)

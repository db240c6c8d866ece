"""Code and paths shared by test modules of several scopes (no test module imports another).

Heavy imports stay inside the functions: scripts run in a subprocess put this folder on sys.path
(TESTS) and import from here, and should not pay for what they do not use."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"

# ---------------------------------------------------------------- training on random token ids

DRAFT_VOCAB = 128
BASE = [
    "target=tiny-llama",
    f"drafter.draft_vocab_size={DRAFT_VOCAB}",
    "train.hidden_states=online",
    "train.ttt_length=3",
    "train.max_length=32",
    "train.batch_size=4",
    "train.bucket_batches=2",
    "train.lr=3e-3",
    "train.warmup_ratio=0.1",
    "train.checkpoint_every_n_steps=2",
    "trainer.accelerator=cpu",
    "trainer.progress_bar=false",
    "tracking.enabled=false",
]


def synthetic_data(target, n_train: int = 24, n_val: int = 8, seed: int = 0):
    """Random sequences (lengths 10..24) over a small token set, a prompt part masked out, and a
    vocab map holding the draft-vocab-size tokens the target predicts most often on them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(target.vocab_size, generator=generator)[:40]

    def item(index: int) -> dict:
        length = int(torch.randint(10, 25, (1,), generator=generator))
        ids = tokens[torch.randint(0, len(tokens), (length,), generator=generator)]
        mask = torch.ones(length, dtype=torch.long)
        mask[:3] = 0
        return {"id": f"s{index}", "input_ids": ids, "loss_mask": mask}

    items = [item(i) for i in range(n_train + n_val)]
    with torch.no_grad():
        predicted = torch.cat(
            [target.model(item["input_ids"][None]).logits[0].argmax(-1) for item in items]
        )
    top = predicted.bincount(minlength=target.vocab_size).topk(DRAFT_VOCAB).indices.sort().values
    d2t = top - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[top] = True
    return items[:n_train], items[n_train:], d2t, t2d


def peaked_target(cfg):
    """The tiny random Llama predicts an almost flat distribution (logit std ~0.2: nothing for a
    drafter to learn from soft labels); its tied embeddings scaled to unit std give the peaked
    next-token distributions of a trained model."""
    from eagle3.core.target import load_target

    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    target.model.get_input_embeddings().weight.data.mul_(50.0)
    return target


def train_settings(cfg):
    """The sections a training reads, as the train stage takes them from `cfg`."""
    from eagle3.train.stage import TrainSettings

    return TrainSettings(cfg.train, cfg.trainer, cfg.drafter, cfg.cluster, cfg.tracking, cfg.seed)


def built_bundle(cfg) -> Path:
    """The bundle `python -m eagle3.tools.bundle` builds for `cfg`: its manifest.json."""
    from eagle3.tools.bundle import build

    named = [cfg.data.source, cfg.drafter.path, cfg.train.init_from, cfg.target.path]
    return build(cfg.bundle, cfg.target, named)


def synthetic_fit(cfg, folder: Path, callbacks=(), target=None, n_train: int = 24):
    from eagle3.train.datamodule import DrafterData
    from eagle3.train.stage import fit

    target = target or peaked_target(cfg)
    train_set, val_set, d2t, t2d = synthetic_data(target, n_train=n_train)
    data = DrafterData(train_set, val_set, cfg.train, cfg.seed, pad_id=0)
    return fit(train_settings(cfg), target, data, folder, d2t, t2d, callbacks=callbacks)


# ---------------------------------------------------------------- training as separate processes

# The train stage that tests run as real processes (nodes on loopback, srun tasks): tiny-llama on
# the fixture conversations, hidden states captured online, DDP over gloo on the CPU.
DDP_STAGE = [
    "target=tiny-llama",
    "data=file",
    f"data.source={FIXTURES / 'conversations.jsonl'}",
    "data.val_fraction=0.2",
    "drafter.draft_vocab_size=256",
    "train.hidden_states=online",
    "train.ttt_length=2",
    "train.max_length=64",
    "train.eval_prompts=0",
    "trainer.accelerator=cpu",
    "trainer.strategy=ddp",
    "trainer.progress_bar=false",
]


def training_overrides(artifacts: Path, *overrides: str) -> list[str]:
    """The stages data -> extract -> train on the conversation fixture, small and on CPU, writing
    into `artifacts`; `overrides` name the target and add or change the rest."""
    return [
        "data=file",
        f"data.source={FIXTURES / 'conversations.jsonl'}",
        "data.val_fraction=0.2",
        "drafter.draft_vocab_size=256",
        f"paths.artifacts={artifacts}",
        "train.ttt_length=2",
        "train.max_length=64",
        "train.batch_size=4",
        "train.epochs=1",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        *overrides,
    ]


def target_folder_overrides(artifacts: Path, folder: Path, *overrides: str) -> list[str]:
    """training_overrides for a target read from `folder` (target=hf), through export."""
    return training_overrides(
        artifacts,
        "target=hf",
        f"target.path={folder}",
        "target.aux_layer_ids=[1,2,3]",
        "target.dtype=float32",
        "train.eval_prompts=0",
        "export.register=false",
        *overrides,
    )


def ddp_stage(test_root: Path, artifacts: Path, *overrides: str) -> list[str]:
    """DDP_STAGE with `overrides`, writing into `artifacts` (a folder of its own: the train output
    of one config is one folder) beside the shared converted targets."""
    artifacts.mkdir(parents=True, exist_ok=True)
    targets = artifacts / "targets"
    if not targets.exists():
        (test_root / "artifacts" / "targets").mkdir(parents=True, exist_ok=True)
        targets.symlink_to(test_root / "artifacts" / "targets")
    return [f"paths.artifacts={artifacts}", *DDP_STAGE, *overrides]


def finish(processes: list, logs: list[Path], timeout_s: float = 600) -> list[tuple[int, str]]:
    """[(returncode, output)] per process, each writing to its log file (a file, so that a process
    never blocks on a full pipe); a process still running at the deadline is killed."""
    import time

    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [
        (proc.returncode, log.read_text(errors="replace")) for proc, log in zip(processes, logs)
    ]


# ---------------------------------------------------------------- drafters for export and engines


def random_vocab_map(target_vocab: int, draft_vocab: int, seed: int = 0):
    import torch

    ids = (
        torch.randperm(target_vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
        .sort()
        .values
    )
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab), t2d


def make_vocab_map(target_argmax, vocab: int, draft_vocab: int, seed: int = 0):
    """A draft vocab holding most (not all) of the target's argmax tokens plus random others,
    so both in-vocab and masked-out positions occur."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    wanted = target_argmax.unique()
    wanted = wanted[torch.randperm(len(wanted), generator=generator)][
        : max(1, len(wanted) * 2 // 3)
    ]
    others = torch.randperm(vocab, generator=generator)[: draft_vocab * 2]
    chosen = torch.cat([wanted, others]).unique(sorted=False)
    chosen = torch.tensor(list(dict.fromkeys(chosen.tolist()))[:draft_vocab]).sort().values
    d2t = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def ttt_case(cfg, target):
    """A batch of random token ids through the target and a fresh drafter with a vocab map (the
    draft vocab size cfg.drafter.draft_vocab_size): (drafter, batch, the target's lm_head weight)."""
    import torch

    from eagle3.core.drafter import build_drafter

    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 14))
    aux, last = target.capture(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :4] = 0  # a prompt part
    loss_mask[1, 9:] = 0
    lm_head = target.model.get_output_embeddings().weight
    drafter = build_drafter(target, cfg.drafter)
    d2t, t2d = make_vocab_map(
        (last @ lm_head.t()).argmax(-1), target.vocab_size, cfg.drafter.draft_vocab_size
    )
    drafter.set_vocab_map(d2t, t2d)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "aux_hidden": aux, "last_hidden": last}
    return drafter, batch, lm_head


def randomise(drafter, seed: int = 0):
    """Random values in every trainable tensor (norms start at 1: a swap would go unnoticed)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.startswith("embed_tokens"):
                param.copy_(torch.randn(param.shape, generator=generator))
    drafter.set_vocab_map(
        *random_vocab_map(drafter.config.vocab_size, drafter.config.draft_vocab_size, seed)
    )
    return drafter


def export_untrained_drafter(cfg, out: Path) -> Path:
    """A seeded, untrained drafter exported by the real exporter (sglang/ and vllm/ folders):
    enough to exercise the engines' speculative paths and counters."""
    from eagle3.core.artifacts import folder_lock

    with folder_lock(out):  # test workers started at once export it once
        if (out / "vllm" / "config.json").exists():
            return out
        return _export_untrained(cfg, out)


def _export_untrained(cfg, out: Path) -> Path:
    import torch

    from eagle3.core.drafter import build_drafter
    from eagle3.core.target import load_target
    from eagle3.export.stage import export_drafter

    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    torch.manual_seed(0)
    drafter = build_drafter(target, cfg.drafter)
    draft_vocab = cfg.drafter.draft_vocab_size
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    drafter.set_vocab_map(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    drafter.config.target_num_layers = target.num_layers
    export_drafter(cfg.export, cfg.target, drafter, {"note": "untrained, for engine tests"}, out)
    return out


# ---------------------------------------------------------------- servers, engines and sweeps


def server_cfg(test_root, *overrides):
    from eagle3.core.common import compose

    return compose(
        [
            f"paths.root={test_root}",
            "target=tiny-llama",
            "spec.depth=4",
            "serve.drafter_fallback=untrained",
            "engine.max_context=64",
            "engine.cpu_threads=1",
            *overrides,
        ]
    )


def http_server_launch(port: int, prefix: str = ""):
    """A real HTTP server standing in for an engine (health = GET / answers 200)."""
    from eagle3.serve.launch import Launch

    command = f"{prefix}exec {sys.executable} -m http.server {port} --bind 127.0.0.1"
    return Launch("local", ["bash", "-c", command], {}, "127.0.0.1", port, health_path="/")


QUICK = ("bench.limit=3", "bench.max_new_tokens=24", "bench.warmup=1")


def run_sweep(
    test_root, tmp_path, *overrides, empty_store: Path | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m eagle3.bench -m ...` into tmp_path/sweep, logging to tmp_path/mlruns; empty_store
    (conftest's): start from a copy of that new store instead of creating one (seconds of schema
    migrations and disk syncs)."""
    sweep_dir = tmp_path / "sweep"
    if empty_store is not None:
        (tmp_path / "mlruns").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(empty_store, tmp_path / "mlruns" / "mlflow.db")
    argv = [
        sys.executable,
        "-m",
        "eagle3.bench",
        "-m",
        *overrides,
        f"paths.root={test_root}",
        f"tracking.uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
        f"tracking.artifact_location={tmp_path}/mlruns/art",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    return out, sweep_dir


# ---------------------------------------------------------------- concurrency sweep results


LOAD_DRAFTER = "/models/drafter/sglang"  # a concurrency sweep's drafter folder


def load_job(spec, depth, steps, topk, batch, tok_s, off_tok_s, step_s, off_step_s, spread=0.0):
    """A bench result as bench.py writes it (the fields the concurrency sweep reads)."""
    speedup = tok_s / off_tok_s
    return {
        "status": "ok",
        "engine": "local",
        "suite": "vicuna",
        "max_new_tokens": 128,
        "drafter": LOAD_DRAFTER if spec != "off" else None,
        "drafter_hash": "abc123",
        "spec": spec,
        "depth": depth,
        "steps": steps,
        "topk": topk,
        "batch_size": batch,
        "tokens_per_s": tok_s,
        "baseline_tokens_per_s": off_tok_s,
        "speedup": speedup,
        "speedup_min": speedup - spread,
        "speedup_max": speedup + spread,
        "step_s": step_s,
        "baseline_step_s": off_step_s,
    }


def load_results():
    """Batch 1: the tree wins, the best chain is d8. Batch 16: d8 is fastest but within noise of
    spec=off (its range reaches below 1), so spec=off is run there."""
    return [
        load_job("off", 1, 0, 1, 1, 100.0, 100.0, 0.010, 0.010),
        load_job("d8", 8, 7, 1, 1, 200.0, 100.0, 0.020, 0.010, 0.05),
        load_job("d32s4k8", 32, 4, 8, 1, 250.0, 100.0, 0.016, 0.010, 0.05),
        load_job("off", 1, 0, 1, 16, 1000.0, 1000.0, 0.016, 0.016),
        load_job("d8", 8, 7, 1, 16, 1040.0, 1000.0, 0.050, 0.016, 0.1),
        load_job("d32s4k8", 32, 4, 8, 16, 800.0, 1000.0, 0.060, 0.016, 0.05),
    ]


def step_recorder():
    """A Lightning callback recording each train step's loss, batch ids and cuDNN attention setting,
    and each validation's tau_hat."""
    import lightning as L
    import torch

    class Recorder(L.Callback):
        def __init__(self):
            self.train_loss, self.val_tau, self.ids, self.cudnn = [], [], [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.train_loss.append(float(outputs["loss"]))
            self.ids.append(list(batch["id"]))
            self.cudnn.append(torch.backends.cuda.cudnn_sdp_enabled())

        def on_validation_end(self, trainer, module):
            self.val_tau.append(float(trainer.callback_metrics["val/tau_hat"]))

    return Recorder()

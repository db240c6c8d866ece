"""Lightning training on the tiny random target: learning, resume after a kill, 2-process ddp,
bucketing, guard rails, NaN stop. Data here is random token ids (the target runs inside the
step: train.hidden_states=online), except the end-to-end test, which runs the real stages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from support import (
    BASE,
    DRAFT_VOCAB,
    TESTS,
    ddp_stage,
    finish,
    peaked_target,
    step_recorder,
    synthetic_data,
    synthetic_fit,
    train_settings,
    training_overrides,
)

from eagle3.core import outputs
from eagle3.core.common import Eagle3Error, compose
from eagle3.core.drafter_io import CHECKPOINTS, load_trained_drafter
from eagle3.core.outputs import train_output
from eagle3.core.target import CompiledCapture, load_target
from eagle3.train.datamodule import BucketBatchSampler, DrafterData, collate
from eagle3.train.drafter_module import DrafterModule, compile_setting, warmup_cosine
from eagle3.train.stage import choose_strategy, evaluation_for, fit
from eagle3.train.ttt import tau_hat


@pytest.fixture(scope="module")
def target(test_root):
    return peaked_target(compose([f"paths.root={test_root}", "target=tiny-llama"]))


def test_loss_decreases_and_tau_rises(make_cfg, target, tmp_path, caplog):
    cfg = make_cfg(*BASE, "train.epochs=4", "train.lr=2e-2", "trainer.log_every_n_steps=5")
    recorder = step_recorder()
    torch.backends.cuda.enable_cudnn_sdp(True)
    with caplog.at_level("INFO", logger="eagle3"):
        metrics = synthetic_fit(cfg, tmp_path / "run", [recorder], target)
    # trainer.cudnn_attention=false holds during the fit only
    assert not any(recorder.cudnn) and len(recorder.cudnn) == 24  # 4 epochs x 6 batches
    assert torch.backends.cuda.cudnn_sdp_enabled()
    # progress bar off: a progress line every 5 of the 24 batches (6 per epoch), with its speed
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: step")]
    assert [m.split()[2] for m in progress] == ["5/24", "10/24", "15/24", "20/24"]
    assert all(float(m.split("samples/s")[0].split()[-1]) > 0 for m in progress)
    assert all(0 <= float(m.split("% between steps")[0].split("(")[-1]) < 100 for m in progress)
    validations = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("train: validation")
    ]
    # one per epoch (6 steps each), none for the sanity check
    assert [m.split(":")[1] for m in validations] == [
        f" validation after epoch {e} (step {6 * e + 6})" for e in range(4)
    ]
    assert float(validations[-1].split("tau_hat ")[1].split(",")[0]) == pytest.approx(
        recorder.val_tau[-1], abs=5e-4
    )
    per_epoch = len(recorder.train_loss) // 4
    first, last = recorder.train_loss[:per_epoch], recorder.train_loss[-per_epoch:]
    assert sum(last) / len(last) < 0.7 * sum(first) / len(first)
    assert recorder.val_tau[-1] > recorder.val_tau[0] + 0.1
    assert metrics["val/tau_hat"] == pytest.approx(recorder.val_tau[-1])
    # train.val_head_tokens (128) spans these short sequences whole: the head metric scores the same
    # predictions, with the out-of-draft-vocab ones as misses, so it cannot exceed the plain one
    assert 1.0 <= metrics["val/tau_hat_head"] <= metrics["val/tau_hat"] + 1e-9
    assert all(
        metrics[f"val/acc_head_{k}"] <= metrics[f"val/acc_{k}"] + 1e-9
        for k in range(cfg.train.ttt_length)
    )
    folder = tmp_path / "run"
    assert (folder / CHECKPOINTS / "best.ckpt").exists() and (
        folder / CHECKPOINTS / "last.ckpt"
    ).exists()
    assert sorted(p.name for p in (folder / CHECKPOINTS).glob("epoch*.ckpt")) == [
        f"epoch{i}.ckpt" for i in range(4)
    ]
    # the exported weights load back into a drafter that reproduces the module's final val metrics
    drafter = load_trained_drafter(folder, target, which="final")
    assert (
        "embed_tokens.weight"
        not in torch.load(folder / CHECKPOINTS / "last.ckpt", weights_only=True)["state_dict"]
    )
    torch.testing.assert_close(
        drafter.embed_tokens.weight, target.model.get_input_embeddings().weight
    )


def test_train_metrics_are_logged_on_log_steps_and_the_last(
    make_cfg, target, tmp_path, monkeypatch
):
    """With the progress bar off, training_step logs its metrics only at the steps Lightning writes to
    the loggers (every trainer.log_every_n_steps) and at the fit's last step, whose loss the result
    reports."""
    logged = []
    log = DrafterModule.log

    def spy(module, name, *args, **kwargs):
        if name.startswith("train/"):
            logged.append((module.global_step, name))
        return log(module, name, *args, **kwargs)

    monkeypatch.setattr(DrafterModule, "log", spy)
    recorder = step_recorder()
    cfg = make_cfg(*BASE, "train.epochs=2", "trainer.log_every_n_steps=5")
    metrics = synthetic_fit(cfg, tmp_path / "run", [recorder], target)
    names = ["train/loss", "train/tau_hat"] + [f"train/acc_{k}" for k in range(3)]
    # 12 steps (2 epochs of 6): Lightning's log steps 5 and 10 (global steps 4 and 9), then the last
    assert logged == [(step, name) for step in (4, 9, 11) for name in names]
    assert len(recorder.train_loss) == 12
    assert metrics["train/loss"] == pytest.approx(recorder.train_loss[-1])


def test_init_from_starts_where_the_source_ended(make_cfg, target, tmp_path):
    """train.init_from loads a trained drafter (its train folder, or its SGLang export) as the start:
    at lr 0 the run ends with exactly the source's weights, where a fresh init ends elsewhere; a
    source of another shape or vocab map is refused, naming what differs."""
    from safetensors.torch import load_file

    from eagle3.core.drafter_io import export_sglang

    source = tmp_path / "source"
    synthetic_fit(make_cfg(*BASE, "train.epochs=1"), source, target=target)
    export_sglang(load_trained_drafter(source, target), tmp_path / "sglang", recipe={})
    trained = load_file(str(source / "best.safetensors"))
    fresh = tmp_path / "fresh"
    synthetic_fit(make_cfg(*BASE, "train.epochs=1", "train.lr=0"), fresh, target=target)
    assert not torch.equal(
        load_file(str(fresh / "drafter.safetensors"))["fc.weight"], trained["fc.weight"]
    )
    for init in (source, tmp_path / "sglang"):
        started = tmp_path / f"from_{init.name}"
        synthetic_fit(
            make_cfg(*BASE, "train.epochs=1", "train.lr=0", f"train.init_from={init}"),
            started,
            target=target,
        )
        weights = load_file(str(started / "drafter.safetensors"))
        assert weights.keys() == trained.keys()
        for key, value in trained.items():
            torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(Eagle3Error, match=r"init_from=.*num_hidden_layers 1 \(this run: 2\)"):
        synthetic_fit(
            make_cfg(*BASE, "drafter.num_layers=2", f"train.init_from={source}"),
            tmp_path / "two",
            target=target,
        )
    train_set, val_set, d2t, t2d = synthetic_data(target)
    t2d = t2d.roll(1)  # the same size, other tokens
    d2t = t2d.nonzero().flatten() - torch.arange(DRAFT_VOCAB)
    with pytest.raises(Eagle3Error, match="vocab map differs"):
        fit(
            train_settings(make_cfg(*BASE, f"train.init_from={source}")),
            target,
            DrafterData(train_set, val_set, make_cfg(*BASE).train, 0, pad_id=0),
            tmp_path / "other_vocab",
            d2t,
            t2d,
        )


def test_bucket_sampler_shards_and_resumes():
    lengths = [5, 9, 3, 12, 7, 7, 1, 20, 11, 4, 6]
    ranks = [
        BucketBatchSampler(lengths, 2, 2, seed=1, shuffle=True, rank=r, world=2) for r in range(2)
    ]
    for sampler in ranks:
        sampler.set_epoch(3)
    batches = [list(s) for s in ranks]
    assert len(batches[0]) == len(batches[1]) == len(ranks[0]) == 3
    seen = [i for rank in batches for batch in rank for i in batch]
    assert sorted(set(seen)) == list(
        range(len(lengths))
    )  # every sequence, the 6th batch wraps around
    for rank in batches:  # within a bucket of 2 batches, lengths are sorted
        for batch in rank:
            assert len(batch) <= 2
    assert list(ranks[0]) == batches[0]  # deterministic per epoch
    ranks[0].resume(3, 2)
    assert list(ranks[0]) == batches[0][2:]
    assert list(ranks[0]) == batches[0]  # the skip applies once
    ranks[0].set_epoch(4)
    assert list(ranks[0]) != batches[0]


def test_compile_settings_and_hash(make_cfg):
    """train.compile_loss / compile_unroll / compile_target: auto follows the device, a bad value names the key, and the
    settings leave the train hash alone (speed options: the shipped drafter's recipe keeps its hash)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_setting("compile_loss", "auto", cuda)
    assert not compile_setting("compile_loss", "auto", cpu)
    assert compile_setting("compile_unroll", True, cpu)
    assert not compile_setting("compile_unroll", False, cuda)
    with pytest.raises(Eagle3Error, match="train.compile_unroll='yes'"):
        compile_setting("compile_unroll", "yes", cpu)
    hashes = {
        train_output(make_cfg(*BASE, f"train.{key}={value}")).hash
        for key in ("compile_loss", "compile_unroll", "compile_target")
        for value in ("auto", "true", "false")
    }
    assert len(hashes) == 1


def test_compiled_target_trains_as_the_hooked_one(make_cfg, target, tmp_path, monkeypatch):
    """train.compile_target=true: the online step reads the target through the compiled forward and its
    losses are the eager run's, step by step (6 steps, the batch of one at the epoch's end included)."""
    captures, call = [], CompiledCapture.__call__

    def spy(capture, input_ids, attention_mask=None):
        captures.append((capture, input_ids.shape[0]))
        return call(capture, input_ids, attention_mask)

    monkeypatch.setattr(CompiledCapture, "__call__", spy)
    losses = []
    for compiled in ("false", "true"):
        recorder = step_recorder()
        cfg = make_cfg(*BASE, "train.epochs=1", f"train.compile_target={compiled}")
        synthetic_fit(cfg, tmp_path / compiled, [recorder], target, n_train=21)
        losses.append(recorder.train_loss)
    train_rows = [rows for _, rows in captures][:6]  # then the validation batches
    assert sorted(train_rows) == [1, 4, 4, 4, 4, 4]
    assert all(c.compiled is not None for c, _ in captures)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_evaluation_prompts_stop_before_the_first_trained_token_and_take_the_engine_settings(
    make_cfg,
):
    """train.eval_prompts: each held-out row up to its first loss-masked token, decoded at the configured
    spec and engine.tree_temperature (what serving would use)."""
    rows = [
        {"input_ids": torch.arange(10), "loss_mask": torch.tensor([0] * 4 + [1] * 6)},
        {"input_ids": torch.arange(5), "loss_mask": torch.zeros(5, dtype=torch.long)},
    ]
    cfg = make_cfg(*BASE, "train.eval_prompts=2", "spec=d6s3k2", "engine.tree_temperature=0.5")
    evaluation = evaluation_for(cfg.train, cfg.spec, cfg.engine.tree_temperature, rows)
    assert evaluation["prompts"] == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert evaluation["tree_temperature"] == 0.5 and evaluation["spec"].label == "d6s3k2"


def test_collate_pads_right_and_truncates():
    items = [
        {
            "id": "a",
            "input_ids": torch.tensor([1, 2, 3]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "aux_hidden": torch.ones(3, 6),
            "last_hidden": torch.ones(3, 2),
        },
        {
            "id": "b",
            "input_ids": torch.tensor([4, 5, 6, 7, 8]),
            "loss_mask": torch.tensor([1, 1, 1, 1, 1]),
            "aux_hidden": torch.ones(5, 6),
            "last_hidden": torch.ones(5, 2),
        },
    ]
    batch = collate(items, max_length=4, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["aux_hidden"][0, 3].abs().sum() == 0 and batch["aux_hidden"].shape == (2, 4, 6)


def test_warmup_cosine_schedule():
    factor = warmup_cosine(100, 0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert (
        factor(10) == pytest.approx(1.0)
        and factor(55) == pytest.approx(0.5)
        and factor(100) == pytest.approx(0)
    )


def test_multirun_switches_ddp_to_spawn(make_cfg):
    cfg = make_cfg("trainer.devices=2", "trainer.strategy=ddp")
    assert choose_strategy(cfg.trainer, multirun=True) == "ddp_spawn"
    assert choose_strategy(cfg.trainer, multirun=False) == "ddp"
    assert (
        choose_strategy(make_cfg().trainer, multirun=True) == "auto"
    )  # one device: nothing relaunches


def test_nan_loss_stops_naming_step_and_keeps_checkpoint(make_cfg, target, tmp_path):
    """A NaN cannot come out of real data here, so a callback poisons the drafter's fc weights
    at step 3 (a simulated fault); the run must stop at that step and keep last.ckpt of step 2."""

    class Poison(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3:
                module.drafter.fc.weight.data.fill_(float("nan"))

    cfg = make_cfg(*BASE, "train.epochs=2")
    with pytest.raises(
        Eagle3Error, match=r"non-finite training loss .* at step 3, epoch 0, batch 3 \(sample ids"
    ):
        synthetic_fit(cfg, tmp_path / "run", [Poison()], target)
    last = torch.load(tmp_path / "run" / CHECKPOINTS / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2
    assert torch.isfinite(last["state_dict"]["drafter.fc.weight"]).all()


SCRIPT = """
import os, signal, sys, json
sys.path.insert(0, {tests!r})
import lightning as L, torch
from eagle3.core.common import compose
from support import synthetic_fit

from eagle3.core.lifecycle import Stopped

class KillAfter(L.Callback):  # a real signal to this process, at a known step's end or validation
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == {kill_at} and not {in_validation}:
            os.kill(os.getpid(), signal.{signal_name})

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if trainer.global_step == {kill_at} and {in_validation}:
            os.kill(os.getpid(), signal.{signal_name})

class Dump(L.Callback):  # what each rank trained on and ended with
    def __init__(self): self.ids = []
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): self.ids += batch["id"]
    def on_train_end(self, trainer, module):
        torch.save({{"ids": self.ids, "state": module.drafter.trainable_state_dict(),
                    "global_step": trainer.global_step}}, {folder!r} + f"/rank{{trainer.global_rank}}.pt")

cfg = compose({overrides!r})
callbacks = [Dump()] + ([KillAfter()] if {kill_at} >= 0 else [])
try:
    synthetic_fit(cfg, __import__("pathlib").Path({folder!r}), callbacks, n_train={n_train})
except Stopped as stop:
    sys.exit(128 + stop.signum)
"""


def run_script(
    tmp_path: Path,
    folder: Path,
    overrides: list[str],
    kill_at: int = -1,
    n_train: int = 24,
    signal_name: str = "SIGKILL",
    in_validation: bool = False,
):
    script = tmp_path / f"train_script_{kill_at}_{signal_name}.py"
    script.write_text(
        SCRIPT.format(
            tests=str(TESTS),
            kill_at=kill_at,
            signal_name=signal_name,
            in_validation=in_validation,
            folder=str(folder),
            overrides=overrides,
            n_train=n_train,
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )


def final_state(folder: Path) -> dict:
    return torch.load(folder / CHECKPOINTS / "last.ckpt", weights_only=False)


def assert_same_training_state(a: dict, b: dict, steps: int) -> None:
    """Two checkpoints hold the same step count, weights, optimizer moments and schedule."""
    assert a["global_step"] == b["global_step"] == steps
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"]):
        for param, state in opt_a["state"].items():
            for name, tensor in state.items():
                assert torch.equal(tensor, opt_b["state"][param][name]), (param, name)
    assert a["lr_schedulers"] == b["lr_schedulers"]


def test_resume_after_kill_is_exact(make_cfg, test_root, target, tmp_path):
    """2 epochs of 3 steps, last.ckpt every 2 steps; SIGKILL at step 5 leaves the step-4 checkpoint
    (one batch into epoch 2), the rerun resumes there; the result equals an uninterrupted run."""
    overrides = [f"paths.root={test_root}", *BASE, "train.epochs=2"]
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    recorder = step_recorder()
    synthetic_fit(compose(overrides), uninterrupted, [recorder], target, n_train=12)
    crashed = run_script(tmp_path, killed, overrides, kill_at=5, n_train=12)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert torch.load(killed / CHECKPOINTS / "last.ckpt", weights_only=False)["global_step"] == 4
    resumed = run_script(
        tmp_path, killed, overrides, n_train=12
    )  # finds last.ckpt, resumes mid-epoch
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert torch.load(killed / "rank0.pt")["ids"] == [
        i for batch in recorder.ids[4:] for i in batch
    ]
    assert sorted(recorder.ids[0]) != sorted(recorder.ids[3])  # epochs are shuffled differently
    assert_same_training_state(final_state(uninterrupted), final_state(killed), steps=6)
    # the resumed run trained exactly on the batches the killed one had not checkpointed
    assert torch.load(killed / "rank0.pt")["ids"] == [
        i for batch in recorder.ids[4:] for i in batch
    ]


@pytest.mark.parametrize(
    "in_validation, step, said",
    [(False, 5, "stopped at step 5"), (True, 3, "stopped in validation")],
)
def test_sigterm_stops_with_a_checkpoint_of_its_step_and_resumes_exactly(
    make_cfg, test_root, target, tmp_path, in_validation, step, said
):
    """A real SIGTERM at the end of step 5, or in the validation after step 3 (2 epochs of 3 steps,
    last.ckpt every 2 steps): the run writes last.ckpt at that step, exits with 128 + SIGTERM, and
    the rerun trains only the steps after it and ends equal to an uninterrupted run."""
    overrides = [f"paths.root={test_root}", *BASE, "train.epochs=2"]
    uninterrupted, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    recorder = step_recorder()
    synthetic_fit(compose(overrides), uninterrupted, [recorder], target, n_train=12)
    cut = run_script(
        tmp_path, stopped, overrides, step, 12, signal_name="SIGTERM", in_validation=in_validation
    )
    assert cut.returncode == 128 + signal.SIGTERM, cut.stderr[-3000:]
    assert said in cut.stderr
    assert final_state(stopped)["global_step"] == step
    resumed = run_script(tmp_path, stopped, overrides, n_train=12)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(stopped / "rank0.pt")["ids"] == [
        i for batch in recorder.ids[step:] for i in batch
    ]
    assert_same_training_state(final_state(uninterrupted), final_state(stopped), steps=6)


def test_ddp_two_processes_gloo(make_cfg, test_root, tmp_path):
    overrides = [
        f"paths.root={test_root}",
        *BASE,
        "train.epochs=1",
        "trainer.devices=2",
        "trainer.strategy=ddp",
    ]
    folder = tmp_path / "ddp"
    done = run_script(tmp_path, folder, overrides, n_train=16)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 2  # 4 batches of 4 over 2 ranks
    seen = [set(rank["ids"]) for rank in ranks]
    assert (
        not seen[0] & seen[1] and len(seen[0] | seen[1]) == 16
    )  # disjoint shards covering the data
    for key, value in ranks[0]["state"].items():  # gradients were all-reduced: identical weights
        assert torch.equal(value, ranks[1]["state"][key]), key
    assert "gloo" in done.stderr.lower() or "distributed_backend=gloo" in done.stdout.lower()


def stage_cfg(make_cfg, artifacts: Path, *overrides: str):
    return make_cfg(
        *training_overrides(
            artifacts,
            "target=tiny-llama",
            "train.epochs=2",
            "train.lr=1e-2",
            "trainer.log_every_n_steps=1",
            *overrides,
        )
    )


def test_end_to_end_offline_with_mlflow_and_guard_rails(make_cfg, test_root, tmp_path):
    """data -> extract -> train on the shipped conversation fixture; the train folder, its MLflow run
    (metrics in the stage's run, measured tau next to tau_hat), a no-op rerun, and the guard rails."""
    import mlflow
    from safetensors.torch import load_file

    from eagle3.core.outputs import train_output
    from eagle3.data import stage as data
    from eagle3.extract import stage as extract
    from eagle3.train.stage import run

    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "targets").symlink_to(test_root / "artifacts" / "targets")
    cfg = stage_cfg(make_cfg, artifacts, "train.eval_prompts=2", "train.eval_max_new_tokens=6")
    data.run(cfg)
    shards = extract.run(cfg)
    out = run(cfg)
    manifest = out.manifest()
    assert manifest["complete"] and manifest["upstream"] == {
        "data": outputs.data_output(cfg).hash,
        "extract": shards.hash,
    }
    assert out.hash == train_output(cfg).hash and "eval_prompts" not in manifest["config"]["train"]
    counts = manifest["counts"]
    assert (
        counts["tokenizer_hash"] == outputs.data_output(cfg).manifest()["counts"]["tokenizer_hash"]
    )
    for name in ("drafter.safetensors", "best.safetensors", "drafter_config.json"):
        assert (out.path / name).exists(), name
    runs = mlflow.search_runs(
        experiment_names=[cfg.tracking.experiment],
        filter_string=f"tags.artifact_hash = '{out.hash}'",
        output_format="list",
    )
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "train"
    metrics = runs[0].data.metrics
    assert (
        metrics["val/tau_hat"] >= 1.0
        and "train/loss" in metrics
        and metrics["val/tau_measured"] >= 1.0
    )
    history = mlflow.tracking.MlflowClient(cfg.tracking.uri).get_metric_history(
        runs[0].info.run_id, "val/tau_hat"
    )
    assert len(history) == 2 and counts["tau_hat"] == pytest.approx(max(m.value for m in history))
    # the last validation's per-TTT-step accuracies, in the manifest too (GPU boxes run without MLflow)
    assert counts["val_acc"] == pytest.approx(
        [metrics[f"val/acc_{k}"] for k in range(cfg.train.ttt_length)]
    )
    assert float(tau_hat(counts["val_acc"])) == pytest.approx(history[-1].value)

    assert run(cfg).hash == out.hash  # complete: a no-op, no second MLflow run
    assert (
        len(
            mlflow.search_runs(
                experiment_names=[cfg.tracking.experiment],
                output_format="list",
                filter_string="tags.stage = 'train'",
            )
        )
        == 1
    )
    target = load_target(cfg.target, cfg.paths.artifacts, device="cpu")
    drafter = load_trained_drafter(out.path, target)
    best = load_file(str(out.path / "best.safetensors"))
    for name, tensor in drafter.trainable_state_dict().items():
        assert torch.equal(tensor, best[name]), name

    # guard rails: each refuses before the first step
    with pytest.raises(
        Eagle3Error, match="drafter.hidden_size=32 but the target's hidden size is 64"
    ):
        run(stage_cfg(make_cfg, artifacts, "drafter.hidden_size=32"))
    with pytest.raises(Eagle3Error, match="flex needs a GPU"):
        run(stage_cfg(make_cfg, artifacts, "train.attention=flex"))
    # shards whose manifest names other data (as shards of another target would); a copied folder
    foreign = tmp_path / "foreign_shards"
    import shutil

    shutil.copytree(shards.path, foreign)
    shard_manifest = json.loads((foreign / "manifest.json").read_text())
    shard_manifest["upstream"]["data"] = "0123456789ab"
    (foreign / "manifest.json").write_text(json.dumps(shard_manifest))
    with pytest.raises(Eagle3Error, match="were extracted from data 0123456789ab"):
        run(stage_cfg(make_cfg, artifacts, f"train.shards={foreign}", "train.epochs=3"))
    # a data stage built with another tokenizer (simulated: its recorded tokenizer hash edited)
    data_out = outputs.data_output(cfg)
    data_manifest = data_out.manifest()
    data_manifest["counts"]["tokenizer_hash"] = "another-tokenizer"
    data_out.manifest_path.write_text(json.dumps(data_manifest))
    with pytest.raises(Eagle3Error, match="built with another tokenizer"):
        run(stage_cfg(make_cfg, artifacts, "train.epochs=3"))


# ---------------------------------------------------------------- checkpoints and the folder's lock


class CrashAt(L.Callback):
    """A crash (an exception) at the end of a step, before that step's checkpoints are written."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def test_a_damaged_last_checkpoint_is_set_aside_and_the_run_resumes_before_it(
    test_root, target, tmp_path, caplog
):
    """2 epochs of 3 steps, last.ckpt every 2 steps: a crash at step 5 leaves last.ckpt of step 4
    and epoch0.ckpt of step 3. last.ckpt cut to half its size (as a full disk left it before saves
    were atomic): the rerun names it in one line, renames it last.ckpt.damaged, resumes from
    epoch0.ckpt, says so, and ends where an uninterrupted run ends."""
    overrides = [f"paths.root={test_root}", *BASE, "train.epochs=2"]
    uninterrupted, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"
    synthetic_fit(compose(overrides), uninterrupted, [], target, n_train=12)
    with pytest.raises(RuntimeError, match="crash at step 5"):
        synthetic_fit(compose(overrides), crashed, [CrashAt(5)], target, n_train=12)
    last, epoch0 = crashed / CHECKPOINTS / "last.ckpt", crashed / CHECKPOINTS / "epoch0.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    cut = last.read_bytes()[: last.stat().st_size // 2]
    last.write_bytes(cut)
    caplog.set_level("INFO", logger="eagle3")
    synthetic_fit(compose(overrides), crashed, [], target, n_train=12)
    said = [r.getMessage() for r in caplog.records if r.name == "eagle3"]
    damaged = [line for line in said if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"train: {last} is damaged (")
    assert damaged[0].endswith("; set aside as last.ckpt.damaged")
    assert f"train: resuming from {epoch0} (step 3), the newest good checkpoint" in said
    assert (crashed / CHECKPOINTS / "last.ckpt.damaged").read_bytes() == cut  # kept as it was
    assert_same_training_state(final_state(uninterrupted), final_state(crashed), steps=6)


def test_without_a_good_checkpoint_training_starts_over_and_says_so(tmp_path, caplog):
    """Every checkpoint damaged: each is set aside (rank 0 only) and the run starts over."""
    from eagle3.train.stage import resume_checkpoint

    folder = tmp_path / "run"
    (folder / CHECKPOINTS).mkdir(parents=True)
    good = {"state_dict": {}, "global_step": 2}
    torch.save(good, folder / CHECKPOINTS / "epoch0.ckpt")
    (folder / CHECKPOINTS / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")
    (folder / CHECKPOINTS / "last.ckpt.damaged").write_bytes(b"an earlier one")
    torch.save([1, 2], folder / "hpc_ckpt_1.ckpt")  # loads, but holds no training state
    caplog.set_level("INFO", logger="eagle3")
    assert resume_checkpoint(folder, set_aside=False) == folder / CHECKPOINTS / "epoch0.ckpt"
    assert (folder / CHECKPOINTS / "last.ckpt").exists()  # another rank: nothing renamed
    (folder / CHECKPOINTS / "epoch0.ckpt").write_bytes(b"")
    caplog.clear()
    assert resume_checkpoint(folder) is None
    said = [r.getMessage() for r in caplog.records if r.name == "eagle3"]
    assert said[-1] == f"train: no good checkpoint left in {folder}: training starts over"
    assert sorted(p.name for p in (folder / CHECKPOINTS).iterdir()) == [
        "epoch0.ckpt.damaged",
        "last.ckpt.damaged",
        "last.ckpt.damaged-2",
    ]
    assert (folder / "hpc_ckpt_1.ckpt.damaged").exists()
    assert any(
        line == f"train: {folder / 'hpc_ckpt_1.ckpt'} is damaged (not a training checkpoint); "
        "set aside as hpc_ckpt_1.ckpt.damaged"
        for line in said
    )


def test_a_checkpoint_save_cut_short_keeps_the_previous_one(tmp_path, monkeypatch):
    """A full disk halfway through a save (simulated: torch.save writes part of the checkpoint and
    raises ENOSPC, which a test cannot make a real disk do): one line naming the file, the previous
    checkpoint unchanged, no partial file left."""
    import errno

    from eagle3.train.callbacks import AtomicCheckpointIO

    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 4}, path)
    save = torch.save

    def disk_full(obj, handle):
        save(obj, handle)
        handle.truncate(handle.tell() // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(Eagle3Error) as refused:
        AtomicCheckpointIO().save_checkpoint({"global_step": 6}, path)
    assert str(refused.value) == (
        f"cannot write the checkpoint {path} (No space left on device); the previous one is kept: "
        "free the space and rerun the same command to resume"
    )
    monkeypatch.setattr(torch, "save", save)
    assert torch.load(path, weights_only=False) == {"global_step": 4}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


@pytest.mark.slow
def test_two_trainings_of_one_config_started_together_train_once(
    make_cfg, test_root, own_artifacts, tmp_path
):
    """Two `python -m eagle3.train` of one config started at once: one trains, the other waits for
    the folder's lock, finds the output finished and does nothing; one MLflow run, FINISHED."""
    from mlflow.tracking import MlflowClient

    from eagle3.data import stage as data

    stage = ddp_stage(
        test_root, own_artifacts, "trainer.strategy=auto", "train.epochs=1", "train.batch_size=4"
    )
    store = tmp_path / "mlruns" / "mlflow.db"
    argv = [
        sys.executable,
        "-m",
        "eagle3.train",
        f"paths.root={tmp_path}",
        f"tracking.uri=sqlite:///{store}",
        f"tracking.artifact_location={tmp_path}/mlruns/artifacts",
        *stage,
    ]
    cfg = make_cfg(*argv[3:])
    data.run(cfg)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"train{i}.log" for i in (0, 1)]
    procs = [
        subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for log in logs
    ]
    results = finish(procs, logs)
    assert [code for code, _ in results] == [0, 0], [out[-3000:] for _, out in results]
    out = train_output(cfg)
    trained = [text for _, text in results if f"train: wrote {out.path}" in text]
    waited = [
        text for _, text in results if f"train: {out.path} is complete, nothing to do" in text
    ]
    assert len(trained) == len(waited) == 1, [text[-3000:] for _, text in results]
    assert "resuming from" not in waited[0] and "Epoch" not in waited[0]
    assert out.complete
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    runs = client.search_runs([experiment], "tags.stage = 'train'")
    assert [r.info.status for r in runs] == ["FINISHED"]

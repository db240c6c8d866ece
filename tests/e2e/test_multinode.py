"""Training across nodes, on loopback, through the train app (`eagle3.train.app.main`: Hydra, the data
stage's output, rank 0's manifest): two "nodes" of one process each (gloo, MASTER_ADDR=127.0.0.1,
NODE_RANK 0 and 1, trainer.num_nodes=2) against one node of two processes (trainer.devices=2), the
same global batch and seed; then one node SIGKILLed mid-run, and the rerun of both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import ddp_stage, finish

from eagle3.core.common import compose
from eagle3.core.outputs import train_output
from eagle3.data import stage as data
from eagle3.serve.launch import free_port

OVERRIDES = [
    "train.batch_size=1",  # the 8 training conversations: 4 steps on each of 2 ranks
    "train.lr=3e-3",
    "train.warmup_ratio=0.1",
    "train.epochs=1",
    "train.checkpoint_every_n_steps=2",
    "tracking.enabled=false",
]

# the train app itself, with a recorder of every rank's loss per step added to its fit
SCRIPT = """
import json, os, signal
import lightning as L
import eagle3.train.app as app

class Losses(L.Callback):  # appended as it goes (a killed rank keeps its lines)
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open({folder!r} + f"/losses-rank{{trainer.global_rank}}.jsonl", "a") as out:
            out.write(json.dumps([trainer.global_step, float(outputs["loss"])]) + "\\n")
        if trainer.global_step == {kill_at} and os.environ.get("NODE_RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill of the second node, at a known step

plain_run = app.run
app.run = lambda cfg: plain_run(cfg, callbacks=[Losses()])
app.main()  # the Hydra app: its overrides are this script's arguments
"""


def start(tmp_path: Path, folder: Path, overrides: list[str], env: dict, log: Path, kill_at=-1):
    """One train app process (a node of one rank, or a node of trainer.devices ranks) recording
    losses into `folder`; its output goes to `log` (a file, so a process never blocks on a full
    pipe)."""
    script = tmp_path / f"multinode_script_{kill_at}.py"
    script.write_text(SCRIPT.format(folder=str(folder), kill_at=kill_at))
    # one torch thread per rank: two ranks on two cores, no thread pool spinning against the other
    threads = {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), *overrides],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **threads, **env},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def two_nodes(tmp_path: Path, folder: Path, overrides: list[str], kill_at: int = -1) -> list:
    """Both nodes started at once on loopback; [(returncode, output)] per node rank."""
    folder.mkdir(parents=True, exist_ok=True)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
    logs = [folder / f"node{rank}-{time.monotonic_ns()}.log" for rank in (0, 1)]
    nodes = [
        start(tmp_path, folder, overrides, {**common, "NODE_RANK": str(rank)}, logs[rank], kill_at)
        for rank in (0, 1)
    ]
    return finish(nodes, logs)


def losses(folder: Path, rank: int) -> dict[int, float]:
    """Step -> loss of one rank (a step trained twice, before a kill and after the resume, must
    have given the same loss both times)."""
    found: dict[int, float] = {}
    for line in (folder / f"losses-rank{rank}.jsonl").read_text().splitlines():
        step, loss = json.loads(line)
        assert found.setdefault(step, loss) == loss, (rank, step)
    return found


def artifacts_with_data(test_root: Path, tmp_path: Path, name: str) -> list[str]:
    """The overrides of a training in an artifacts folder of its own holding the data stage's output."""
    overrides = [f"paths.root={test_root}", *ddp_stage(test_root, tmp_path / name, *OVERRIDES)]
    data.run(compose(overrides))
    return overrides


@pytest.mark.slow
def test_two_nodes_equal_one_node_and_resume_after_a_node_is_killed(test_root, tmp_path):
    one_node = artifacts_with_data(test_root, tmp_path, "one-node-artifacts")
    one = tmp_path / "one-node"
    one.mkdir()
    log = tmp_path / "one-node.log"
    [(code, out)] = finish([start(tmp_path, one, [*one_node, "trainer.devices=2"], {}, log)], [log])
    assert code == 0, out[-3000:]
    assert "train: wrote" in out
    expected = [losses(one, rank) for rank in (0, 1)]
    steps = sorted(expected[0])
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4, steps

    base = artifacts_with_data(test_root, tmp_path, "two-node-artifacts")
    nodes = tmp_path / "two-nodes"
    overrides = [*base, "trainer.devices=1", "trainer.num_nodes=2"]
    folder = train_output(compose(overrides)).path
    (code0, out0), (code1, out1) = two_nodes(tmp_path, nodes, overrides, kill_at=3)
    assert code1 == -signal.SIGKILL, out1[-3000:]
    assert code0 != 0  # the surviving node fails instead of waiting for its peer
    assert "lost a process" in out0 and "rerun" in out0, out0[-3000:]
    last = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2  # checkpoints every 2 steps: the one before the kill
    assert not train_output(compose(overrides)).complete

    (code0, out0), (code1, out1) = two_nodes(tmp_path, nodes, overrides)
    assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
    assert "resuming from" in out0
    # node 0 alone wrote the manifest; node 1 ended after it
    assert "train: wrote" in out0 and "train: wrote" not in out1
    assert f"train: rank 1 done; rank 0 wrote {folder}" in out1
    assert train_output(compose(overrides)).complete
    for rank in (0, 1):  # steps 1-3 before the kill, then 3 on again from the step-2 checkpoint
        lines = (nodes / f"losses-rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)[0] for line in lines] == [1, 2, 3, *steps[2:]]
    # every step's loss on every rank equals the one-node run's: the same global batch and seed
    assert [losses(nodes, rank) for rank in (0, 1)] == expected
    final = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    assert final["global_step"] == steps[-1]
    reference = train_output(compose(one_node)).path / "checkpoints" / "last.ckpt"
    reference = torch.load(reference, weights_only=False)
    for key, value in reference["state_dict"].items():
        assert torch.equal(value, final["state_dict"][key]), key

"""Secrets never reach a file: MLflow params and artifacts, Hydra's saved configs, the engine's
command.json and config, stage manifests. And a brand-new MLflow store is created once when
several processes start on it together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.core.redact import MASK, mask, mask_argv, mask_text

SECRETS = ("hf_s3cr3tvalue", "sk-0penai0000", "p4ssw0rd!x", "bench-k3y-xyz", "hf_f1ag")
# values whose names say nothing: an engine's environment keeps its names only, a URL its user
ENV_SECRETS = ("dbPW0rdq", "hfAuthV4lue", "awsS3ssionV4l", "urlPW0rdz")
# parts of values that a pattern ending at `/`, `@`, `,` or a space would leave in clear: a URL password
# holding `/` or `@`, an environment value holding a comma or a space
PARTS = ("sl4shPre", "sl4shPost", "atPre9", "atPost9", "cmA1x", "cmB2y", "spA1x", "spB2y")


def test_mask_rules():
    tree = {
        "serve": {
            "env": {"HF_TOKEN": "hf_x", "VLLM_CPU_KVCACHE_SPACE": 2, "MY_SECRET": 12345},
            "api_key_env": "EAGLE3_API_KEY",
            "default_max_tokens": 128,
            "extra_args": ["--hf-token", "hf_y", "--api-key=abc", "--dtype", "auto"],
        },
        "data": {"regen": {"api_key": "sk-1", "max_new_tokens": 512, "db_password": "pw"}},
        "extract": {"batch_tokens": 16384},
        "speculative_tokens": 3,
    }
    assert mask(tree) == {
        "serve": {
            "env": {"HF_TOKEN": MASK, "VLLM_CPU_KVCACHE_SPACE": MASK, "MY_SECRET": MASK},
            "api_key_env": "EAGLE3_API_KEY",
            "default_max_tokens": 128,
            "extra_args": ["--hf-token", MASK, f"--api-key={MASK}", "--dtype", "auto"],
        },
        "data": {"regen": {"api_key": MASK, "max_new_tokens": 512, "db_password": MASK}},
        "extract": {"batch_tokens": 16384},
        "speculative_tokens": 3,
    }
    assert mask_argv(["serve.env.HF_TOKEN=hf_x", "bench.max_new_tokens=64", "+a.secret=s"]) == [
        f"serve.env.HF_TOKEN={MASK}",
        "bench.max_new_tokens=64",
        f"+a.secret={MASK}",
    ]
    assert (
        mask_text("serve.env.HF_TOKEN=hf_x,spec.depth=3")
        == f"serve.env.HF_TOKEN={MASK},spec.depth=3"
    )
    assert mask_text("x --api-key abc --port 1") == f"x --api-key {MASK} --port 1"
    assert mask_argv(["+serve.env.DATABASE_URL=postgres://bob:pw@db", "serve.env.N=2"]) == [
        f"+serve.env.DATABASE_URL={MASK}",
        f"serve.env.N={MASK}",
    ]
    assert mask({"uri": "postgres://bob:SECRET@db/x", "url": "http://bob@h:80/v1"}) == {
        "uri": f"postgres://bob:{MASK}@db/x",
        "url": "http://bob@h:80/v1",
    }
    # a password holding `/`, `@` or `:` is masked whole; an `@` in a path is no password
    assert mask_text("at http://bob:a/b@c:d@h:9/v1 (x)") == f"at http://bob:{MASK}@h:9/v1 (x)"
    assert mask_text("git+https://host/org/repo@v1 http://h:80/v1") == (
        "git+https://host/org/repo@v1 http://h:80/v1"
    )
    # an override's value is masked whole, whatever quotes, commas or spaces it holds
    assert mask_argv(["+serve.env.A='x1,y2'", 'serve.env.B="x1 y2"', "a.api_key=x\\,y"]) == [
        f"+serve.env.A={MASK}",
        f"serve.env.B={MASK}",
        f"a.api_key={MASK}",
    ]
    assert (
        mask_text("spec.depth=3,+serve.env.A='x1, y2',b=1")
        == f"spec.depth=3,+serve.env.A={MASK},b=1"
    )


def files_containing(root: Path, needles) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {n}" for n in needles if n.encode() in data]
    return hits


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_no_secret_reaches_any_file(test_root, tmp_path, sweep):
    """A bench run (or a one-job sweep, whose saved overrides Hydra escapes and whose multirun.yaml
    it saves after the sweep starts) given secrets on the command line and in the environment
    (refused before launch, so it is fast) writes none of them: Hydra's .hydra files and
    multirun.yaml, the MLflow store (params, tags, config.yaml artifact) and the job's files all
    hold *** instead."""
    env = {**os.environ, "EAGLE3_API_KEY": SECRETS[3]}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.bench",
            *(["-m"] if sweep else []),
            f"paths.root={tmp_path}",
            f"paths.artifacts={test_root / 'artifacts'}",
            f"tracking.uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
            f"tracking.artifact_location={tmp_path}/mlruns/artifacts",
            "serve=vllm",
            "target=tiny-llama",
            "drafter.draft_vocab_size=77",  # a config nothing trained: the job fails before launch
            "spec.depth=4",
            f"+serve.env.HF_TOKEN={SECRETS[0]}",
            f"+serve.env.DATABASE_URL=postgres://bob:{ENV_SECRETS[0]}@db",
            f"+serve.env.HF_AUTH={ENV_SECRETS[1]}",
            f"+serve.env.AWS_SESSION_CREDENTIALS={ENV_SECRETS[2]}",
            f"data.regen.base_url=http://bob:{ENV_SECRETS[3]}@127.0.0.1:9/v1",
            f"+serve.env.DB_PASSWORD='{SECRETS[2]}'",
            f"data.regen.model=http://bob:{PARTS[0]}/{PARTS[1]}@127.0.0.1:9/v1",
            f"data.source=postgres://bob:{PARTS[2]}@{PARTS[3]}@db/x",
            f"+serve.env.COMMA_VALUE='{PARTS[4]},{PARTS[5]}'",
            f"+serve.env.SPACE_VALUE='{PARTS[6]} {PARTS[7]}'",
            f"serve.extra_args=[--hf-token,{SECRETS[4]},--api-key,{SECRETS[1]}]",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 1 and "no exported drafter" in out.stderr, out.stderr[-2000:]
    saved = list(tmp_path.rglob(".hydra/*.yaml"))
    assert {p.name for p in saved} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert len(list(tmp_path.rglob("multirun.yaml"))) == int(sweep)
    overrides = (saved[0].parent / "overrides.yaml").read_text()
    assert "HF_TOKEN=***" in overrides and "DATABASE_URL=***" in overrides
    assert (tmp_path / "mlruns" / "mlflow.db").exists()
    assert files_containing(tmp_path, SECRETS + ENV_SECRETS + PARTS) == []
    assert not any(s in out.stdout + out.stderr for s in SECRETS + ENV_SECRETS + PARTS)


STORE_USER = """
import pathlib, sys, time
from eagle3.core.common import compose
from eagle3.core.tracking import stage_run
cfg = compose([f"tracking.uri=sqlite:///{sys.argv[1]}/mlflow.db",
               f"tracking.artifact_location={sys.argv[1]}/artifacts"])
ready = pathlib.Path(sys.argv[1], "ready")
(ready / sys.argv[2]).touch()
deadline = time.time() + 120  # a peer that failed to start does not hold the others forever
while len(list(ready.iterdir())) < int(sys.argv[3]) and time.time() < deadline:
    time.sleep(0.005)  # all processes start together
with stage_run(cfg, "probe"):
    pass
print("ok")
"""


def test_processes_starting_on_a_new_store_at_once_all_succeed(tmp_path):
    (tmp_path / "ready").mkdir()  # each process marks itself ready once it has imported eagle3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STORE_USER, str(tmp_path), str(index), "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(3)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [o.strip().splitlines()[-1] for o in outputs] == ["ok"] * 3, outputs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert len(client.search_experiments()) == 2  # Default + eagle3, created once
    experiment = client.get_experiment_by_name("eagle3")
    assert len(client.search_runs([experiment.experiment_id])) == 3


def test_the_bench_sends_the_api_key_the_server_requires(
    make_cfg, tmp_path, own_artifacts, monkeypatch
):
    """EAGLE3_API_KEY set: the local server refuses requests without it (401), so a job that
    measures at all has sent it; the key is in no file of the job."""
    from eagle3.bench.app import run_job

    monkeypatch.setenv("EAGLE3_API_KEY", SECRETS[3])
    cfg = make_cfg(
        "target=tiny-llama",
        "spec=off",
        "engine.cpu_threads=1",
        "bench.limit=2",
        "bench.warmup=0",
        "bench.max_new_tokens=4",
        "bench.repeats=1",
        "bench.reuse_baseline=false",
        f"paths.artifacts={own_artifacts}",
    )
    result = run_job(cfg, tmp_path / "job")
    assert result["status"] == "ok", result.get("error")
    assert result["output_tokens"] == 8
    assert files_containing(tmp_path, SECRETS) == []


def test_vllm_and_sglang_get_the_key_without_logging_it(make_cfg, monkeypatch):
    from eagle3.core.spec import OFF
    from eagle3.serve.launch import compose_launch, engine_setup

    monkeypatch.setenv("EAGLE3_API_KEY", "k-123")
    vllm = compose_launch(
        engine_setup(make_cfg("serve=vllm", "spec=off")), OFF, None, "/models/target"
    )
    assert vllm.env["VLLM_API_KEY"] == "k-123" and "k-123" not in " ".join(vllm.argv)
    assert vllm.headers == {"Authorization": "Bearer k-123"} and "k-123" not in repr(vllm)
    assert mask(vllm.env, in_env=True)["VLLM_API_KEY"] == MASK
    sglang = compose_launch(
        engine_setup(make_cfg("serve=sglang", "serve.version=0.5.20", "serve.validate_args=false")),
        OFF,
        None,
        "/models/target",
    )
    at = sglang.argv.index("--api-key")
    assert sglang.argv[at + 1] == "k-123" and mask_argv(sglang.argv)[at + 1] == MASK


def test_an_engine_log_tail_is_masked(tmp_path):
    from eagle3.serve.launch import EngineProcess, Launch

    engine = EngineProcess(Launch("sglang", ["true"], {}, "127.0.0.1", 1), tmp_path)
    engine.log_path.write_text("server_args=ServerArgs(api_key='k-9', port=1)\n--api-key k-9\n")
    assert "k-9" not in engine.log_tail() and engine.log_tail().count(MASK) == 2


def test_a_url_password_in_an_error_line_is_masked(test_root, own_artifacts, tmp_path):
    """The regeneration endpoint is down: the one-line error names the URL with its password masked
    (one holding `@` and `:`), in the terminal and the job's log; a password holding `/` (which the
    client cannot send unencoded) is refused naming the URL masked, before any request."""
    from support import FIXTURES

    def data_app(url: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "eagle3.data",
                f"paths.root={tmp_path}",
                f"paths.artifacts={own_artifacts}",
                "tracking.enabled=false",
                "target=tiny-llama",
                "data=file",
                f"data.source={FIXTURES / 'conversations.jsonl'}",
                "data.limit=2",
                "data.regenerate=true",
                "data.regen.backend=openai",
                f"data.regen.base_url={url}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def error_lines(proc) -> list[str]:  # the line may follow a progress bar's last state
        lines = proc.stderr.splitlines()
        return [line[line.index("eagle3 error") :] for line in lines if "eagle3 error" in line]

    down = data_app(f"http://bob:{PARTS[2]}@:{PARTS[3]}@127.0.0.1:9/v1")
    assert down.returncode == 1
    assert error_lines(down) == [
        "eagle3 error: cannot list models at http://bob:***@127.0.0.1:9/v1/models (ConnectError); "
        "is the server up? Or set data.regen.model  (add debug=true for the traceback)"
    ]
    slash = data_app(f"http://bob:{PARTS[0]}/{PARTS[1]}@127.0.0.1:9/v1")
    assert slash.returncode == 1
    assert error_lines(slash) == [
        "eagle3 error: data.regen.base_url=http://bob:***@127.0.0.1:9/v1 is not a URL the client "
        "can request (a '/' in its password must be percent-encoded as %2F)  "
        "(add debug=true for the traceback)"
    ]
    assert not any(p in down.stderr + slash.stderr for p in PARTS)
    assert files_containing(tmp_path, PARTS) == []

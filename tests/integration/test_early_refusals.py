"""Faults refused early and in one line: settings an engine cannot honour before the target is
prepared, a drafter for another target before spec=off is measured, a misspelt sweep key before the
sweep's folder or run exists, and damaged files (a JSON file cut short, a safetensors header
overwritten in place, a prompt that is not Unicode, a folder eagle3 may not write) named by path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.core.common import Eagle3Error


def run_app(module: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def error_lines(stderr: str) -> list[str]:
    """The app's error lines (one may follow a progress bar's last state on the same line)."""
    return [
        line[line.index("eagle3 error") :] for line in stderr.splitlines() if "eagle3 error" in line
    ]


# ---------------------------------------------------------------- checks that come early


def test_max_new_tokens_beyond_the_context_is_refused_before_the_target_is_prepared(
    make_cfg, tmp_path
):
    """A target folder that does not exist would fail its preparation (a real target's conversion
    takes 40 s): the context the settings give is checked first."""
    from eagle3.bench.checks import bench_requests

    cfg = make_cfg(
        "target=hf", f"target.path={tmp_path / 'no-model'}", "bench.max_new_tokens=100000"
    )
    with pytest.raises(Eagle3Error) as refused:
        bench_requests(cfg.bench, cfg.serve, cfg.engine, cfg.target, cfg.paths.artifacts)
    assert str(refused.value) == (
        "bench.max_new_tokens=100000 does not fit the local engine's context of 4,096 tokens "
        "(engine.max_context), prompt and completion together: ask for fewer tokens"
    )


def test_a_drafter_for_another_target_is_refused_before_spec_off_is_measured(
    make_cfg, tmp_path, tiny_drafter
):
    """tiny-llama's drafter against a tiny-llama of hidden size 32: the job fails naming both sizes,
    and no spec=off measurement was made (no baseline folder, no baseline output)."""
    from eagle3.bench.app import run_job

    artifacts = tmp_path / "artifacts"
    cfg = make_cfg(
        "target=tiny-llama",
        "target.hidden_size=32",
        "target.intermediate_size=64",
        f"drafter.path={tiny_drafter}",
        "spec.depth=2",
        "bench.limit=1",
        "bench.max_new_tokens=4",
        "bench.warmup=0",
        "bench.repeats=1",
        f"paths.artifacts={artifacts}",
    )
    (artifacts / "targets").parent.mkdir(parents=True)
    (artifacts / "targets").symlink_to(Path(cfg.paths.root) / "artifacts" / "targets")
    result = run_job(cfg, tmp_path / "job")
    assert result["status"] == "failed"
    assert result["error"].startswith(
        f"Eagle3Error: drafter {tiny_drafter / 'sglang'} does not fit"
    )
    assert result["error"].endswith("drafter expects target hidden size 64, target has 32")
    assert not (tmp_path / "job" / "baseline").exists()
    assert not (artifacts / "bench_baseline").exists()


def test_a_misspelt_key_in_a_sweep_leaves_no_run_and_no_sweep_folder(tmp_path):
    store = tmp_path / "mlruns" / "mlflow.db"
    out = run_app(
        "eagle3.bench",
        "-m",
        "spec.depht=16,10",
        "target=tiny-llama",
        f"paths.root={tmp_path}",
        f"tracking.uri=sqlite:///{store}",
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert error_lines(out.stderr) == [
        "eagle3 error: sweep job spec.depht=16: Could not override 'spec.depht'. "
        "Key 'depht' not in 'SpecConfig'"
    ]
    assert not (tmp_path / "multirun").exists() and not store.exists()  # no sweep, no run


# ---------------------------------------------------------------- one line naming the file


@pytest.fixture
def drafter_copy(tiny_drafter, tmp_path) -> Path:
    """A copy of the exported untrained tiny-llama drafter (sglang/, vllm/) to damage."""
    copy = tmp_path / "drafter"
    shutil.copytree(tiny_drafter, copy)
    return copy


def test_a_drafter_config_cut_short_is_named(make_cfg, drafter_copy):
    from eagle3.core.outputs import resolve_drafter_path

    config = drafter_copy / "sglang" / "config.json"
    config.write_bytes(config.read_bytes()[:100])
    with pytest.raises(Eagle3Error) as refused:
        resolve_drafter_path(make_cfg(f"drafter.path={drafter_copy}"), engine="sglang")
    assert str(refused.value).startswith(f"{config} is not valid JSON (")
    assert str(refused.value).endswith("cut short or damaged; export or copy the drafter again")


def test_a_manifest_cut_short_is_named_with_the_command_that_redoes_it(tmp_path):
    from eagle3.core.artifacts import stage_output

    out = stage_output(tmp_path, "export", {"export": {"dtype": None}})
    out.start()
    out.finish({})
    out.manifest_path.write_text(out.manifest_path.read_text()[:50])
    with pytest.raises(Eagle3Error) as refused:
        out.reusable(verify=False)
    assert str(refused.value).startswith(f"{out.manifest_path} is not valid JSON (")
    assert str(refused.value).endswith(
        f"cut short or damaged; remove {out.path} and rerun `python -m eagle3.export` to redo "
        "the output"
    )


@pytest.mark.parametrize(
    "old, new, reason",
    [
        (b'"data_offsets"', b'"data_offsetz"', "has no data offsets"),  # a key overwritten
        (b'"dtype":"F32"', b'"dtype":"X32"', "the header was overwritten"),  # a dtype overwritten
    ],
)
def test_a_safetensors_header_overwritten_in_place_is_named(drafter_copy, old, new, reason):
    """The same size (the manifest's size check passes): the header check and the loader name the
    file instead of a KeyError or safetensors' traceback."""
    from eagle3.core.artifacts import load_safetensors
    from eagle3.core.outputs import check_drafter_files

    folder = drafter_copy / "sglang"
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    assert old in data[:4096]
    weights.write_bytes(data.replace(old, new, 1))
    assert weights.stat().st_size == len(data)
    with pytest.raises(Eagle3Error, match="is not a readable safetensors file") as refused:
        check_drafter_files(folder, verify=False)
    assert str(refused.value).startswith(str(weights)) and reason in str(refused.value)
    with pytest.raises(Eagle3Error) as refused:
        load_safetensors(weights)
    assert str(refused.value).startswith(f"{weights} is not a readable safetensors file (")


def test_a_prompt_holding_a_lone_surrogate_is_refused_naming_the_row(make_cfg, tmp_path):
    from eagle3.data.suites import load_suite

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "half a pair: \\ud800 here"}\n')
    with pytest.raises(Eagle3Error) as refused:
        load_suite(make_cfg(f"bench.prompts={prompts}").bench)
    assert str(refused.value) == (
        f"{prompts} row 1: a lone surrogate '\\ud800' at character 13 is not valid Unicode "
        "(write both halves of a surrogate pair, or the character itself)"
    )


def unwritable(folder: Path) -> None:
    """Make `folder` refuse new files: its mode (not enough for root, who passes mode checks), and
    the immutable attribute (chattr +i) as root."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
    probe = folder / "probe"
    with pytest.raises(PermissionError):
        probe.touch()


def test_a_read_only_export_folder_is_one_line(test_root, tmp_path):
    artifacts = tmp_path / "artifacts"
    (artifacts / "export").mkdir(parents=True)
    (artifacts / "targets").symlink_to(test_root / "artifacts" / "targets")
    unwritable(artifacts / "export")
    try:
        out = run_app(
            "eagle3.export",
            "target=tiny-llama",
            f"paths.root={tmp_path}",
            f"paths.artifacts={artifacts}",
            "tracking.enabled=false",
        )
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(artifacts / "export")], check=True)
        (artifacts / "export").chmod(0o755)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"eagle3 error: {artifacts / 'export'}/") and line.endswith(
        "; make it writable, or set paths.artifacts (or paths.root) to a folder you can write  "
        "(add debug=true for the traceback)"
    )

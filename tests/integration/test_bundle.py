"""python -m eagle3.tools.bundle and its run.py: a bundle built here in small parts, gathered from two
copies, checked, installed and turned into a step's command, as on a machine without network."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3.core.common import Eagle3Error
from eagle3.tools import bundle_run
from eagle3.tools.bundle import build


def tiny_wheel(folder):
    """A pure-Python wheel of a package `bundletiny` (a real wheel pip installs, built by hand: the
    test machine has no network for a downloaded one)."""
    folder.mkdir(parents=True)
    wheel = folder / "bundletiny-1.0-py3-none-any.whl"
    info = "bundletiny-1.0.dist-info"
    files = {
        "bundletiny/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: bundletiny\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", record)
    return folder


def make_bundle(make_cfg, tmp_path, *overrides):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": str(i), "prompt": "x" * 50}) + "\n" for i in range(200))
    )
    cfg = make_cfg(
        "target=tiny-llama",
        f"data.source={prompts}",
        f"bundle.out={tmp_path / 'bundle'}",
        "bundle.packages=[]",
        f"bundle.wheel_dirs=[{tiny_wheel(tmp_path / 'wheels')}]",
        "bundle.source=false",
        "bundle.part_mib=0.004",
        *overrides,
    )
    return cfg, build(cfg), prompts


def test_a_bundle_in_parts_installs_once_every_part_has_arrived(make_cfg, tmp_path):
    cfg, manifest_path, prompts = make_bundle(make_cfg, tmp_path)
    manifest = json.loads(manifest_path.read_text())
    out = manifest_path.parent
    assert len(manifest["parts"]) >= 3 and all(
        p["bytes"] <= 0.004 * 2**20 for p in manifest["parts"]
    )
    assert manifest["wheels"] == ["bundletiny-1.0-py3-none-any.whl"]
    assert manifest["files"] == ["prompts.jsonl"] and (out / "run.py").exists()
    # the parts arrive in two copies; the first leaves the rest missing, by name
    first, second, home = tmp_path / "copy1", tmp_path / "copy2", tmp_path / "home"
    for folder, parts in ((first, manifest["parts"][:2]), (second, manifest["parts"][2:])):
        folder.mkdir()
        for part in parts:
            shutil.copy(out / part["name"], folder / part["name"])
    missing = bundle_run.gather(manifest, [first], home)
    assert missing == [p["name"] for p in manifest["parts"][2:]]
    assert bundle_run.gather(manifest, [second], home) == []
    unpacked = bundle_run.install(manifest, home)
    assert (unpacked / "files" / "prompts.jsonl").read_bytes() == prompts.read_bytes()
    check = [sys.executable, "-c", "import bundletiny; print(bundletiny.VALUE)"]
    assert (
        subprocess.run(
            check, env={"PYTHONPATH": str(home / "site")}, capture_output=True, text=True
        ).stdout.strip()
        == "42"
    )
    argv, env, cwd = bundle_run.step_command("train", ["experiment=quickstart"], home)
    assert argv[1:] == ["-m", "eagle3.train", "experiment=quickstart"]
    # built without source (bundle.source=false): the step runs in the checkout run.py is called from
    assert env["BUNDLE_FILES"] == str(home / "bundle" / "files") and cwd == Path.cwd()
    assert env["PYTHONPATH"].split(":")[:2] == [str(home / "site"), str(cwd / "src")]
    (home / "bundle" / "source").mkdir()
    _, env, cwd = bundle_run.step_command("train", [], home)
    assert cwd == home / "bundle" / "source"
    assert env["PYTHONPATH"].split(":")[:2] == [str(home / "site"), str(cwd / "src")]


def test_run_py_names_missing_parts_and_refuses_a_damaged_one(make_cfg, tmp_path):
    _, manifest_path, _ = make_bundle(make_cfg, tmp_path)
    out, manifest = manifest_path.parent, json.loads(manifest_path.read_text())
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "run.py", alone)
    shutil.copy(manifest_path, alone)
    shutil.copy(out / manifest["parts"][0]["name"], alone)
    run = [sys.executable, str(alone / "run.py"), "--home", str(tmp_path / "home"), "install"]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 3 and manifest["parts"][-1]["name"] in done.stdout
    damaged = alone / manifest["parts"][1]["name"]
    damaged.write_bytes(b"not the part")
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 2 and f"{damaged}: its sha256 is not the manifest's" in done.stderr
    with pytest.raises(bundle_run.BundleError, match="unknown step 'deploy'"):
        bundle_run.step_command("deploy", [], tmp_path)


def test_a_missing_extra_file_is_named(make_cfg, tmp_path):
    with pytest.raises(Eagle3Error, match="bundle.files: /nonexistent/x.jsonl does not exist"):
        make_bundle(make_cfg, tmp_path, "bundle.files=[/nonexistent/x.jsonl]")


def test_a_step_run_from_a_bundle_records_the_commit_it_was_packed_from(make_cfg, tmp_path):
    """The bundled source has no git history; its runs and manifests still name the commit."""
    from eagle3.core.artifacts import git_commit

    _, manifest_path, _ = make_bundle(
        make_cfg, tmp_path, "bundle.source=true", "bundle.part_mib=64"
    )
    manifest = json.loads(manifest_path.read_text())
    home = tmp_path / "home"
    assert bundle_run.gather(manifest, [manifest_path.parent], home) == []
    bundle_run.install(manifest, home)
    _, env, cwd = bundle_run.step_command("bench", [], home)
    probe = "from eagle3.core.artifacts import git_commit; print(git_commit())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert done.stdout.strip() == git_commit() != "None", done.stderr
    assert sorted(p.name for p in manifest_path.parent.iterdir()) == sorted(
        [bundle_run.MANIFEST, "run.py", *(p["name"] for p in manifest["parts"])]
    )

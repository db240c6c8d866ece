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
from support import built_bundle

from eagle3.core.common import Eagle3Error
from eagle3.tools import bundle_run


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
    return cfg, built_bundle(cfg), prompts


def all_parts(manifest: dict) -> list[dict]:
    return [part for pack in manifest["packs"] for part in pack["parts"]]


def test_a_bundle_in_parts_installs_once_every_part_has_arrived(make_cfg, tmp_path):
    cfg, manifest_path, prompts = make_bundle(make_cfg, tmp_path)
    manifest = json.loads(manifest_path.read_text())
    out, parts = manifest_path.parent, all_parts(manifest)
    assert [p["name"] for p in manifest["packs"]] == ["base", "files"]
    assert len(parts) >= 3 and all(p["bytes"] <= 0.004 * 2**20 for p in parts)
    packs = {p["name"]: p["members"] for p in manifest["packs"]}
    assert packs == {
        "base": ["wheels/bundletiny-1.0-py3-none-any.whl"],
        "files": ["files/prompts.jsonl"],
    }
    assert (out / "run.py").exists()
    # the parts arrive in two copies; the first leaves the rest missing, by name
    first, second, home = tmp_path / "copy1", tmp_path / "copy2", tmp_path / "home"
    for folder, some in ((first, parts[:2]), (second, parts[2:])):
        folder.mkdir()
        for part in some:
            shutil.copy(out / part["name"], folder / part["name"])
    missing = bundle_run.gather(manifest, [first], home)
    assert missing == [p["name"] for p in parts[2:]]
    assert bundle_run.gather(manifest, [second], home) == []
    assert bundle_run.install(manifest, home) == []
    unpacked = home / "bundle"
    assert (unpacked / "files" / "prompts.jsonl").read_bytes() == prompts.read_bytes()
    check = [sys.executable, "-c", "import bundletiny; print(bundletiny.VALUE)"]
    assert (
        subprocess.run(
            check, env={"PYTHONPATH": str(home / "site")}, capture_output=True, text=True
        ).stdout.strip()
        == "42"
    )
    argv, env, cwd = bundle_run.step_command(manifest, "train", ["experiment=quickstart"], home)
    assert argv[1:] == ["-m", "eagle3.train", "experiment=quickstart"]
    # built without source (bundle.source=false): the step runs in the checkout run.py is called from
    assert env["BUNDLE_FILES"] == str(home / "bundle" / "files") and cwd == Path.cwd()
    assert env["PYTHONPATH"].split(":")[:2] == [str(home / "site"), str(cwd / "src")]
    (home / "bundle" / "source").mkdir()
    _, env, cwd = bundle_run.step_command(manifest, "train", [], home)
    assert cwd == home / "bundle" / "source"
    assert env["PYTHONPATH"].split(":")[:2] == [str(home / "site"), str(cwd / "src")]


def test_run_py_names_missing_parts_and_refuses_a_damaged_one(make_cfg, tmp_path):
    _, manifest_path, _ = make_bundle(make_cfg, tmp_path)
    out, manifest = manifest_path.parent, json.loads(manifest_path.read_text())
    parts = all_parts(manifest)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "run.py", alone)
    shutil.copy(manifest_path, alone)
    shutil.copy(out / parts[0]["name"], alone)
    run = [sys.executable, str(alone / "run.py"), "--home", str(tmp_path / "home"), "install"]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 3 and parts[-1]["name"] in done.stdout
    damaged = alone / parts[1]["name"]
    damaged.write_bytes(b"not the part")
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 2 and f"{damaged}: its sha256 is not the manifest's" in done.stderr
    with pytest.raises(bundle_run.BundleError, match="unknown step 'deploy'"):
        bundle_run.step_command(manifest, "deploy", [], tmp_path)


def test_run_py_takes_a_steps_arguments_in_any_order():
    """`run.py run bench serve=x -m spec.depth=16,10`: everything after the step is the step's,
    Hydra's -m included; `run.py test ...` hands its arguments to pytest."""
    args = bundle_run.parse(["run", "bench", "serve=sglang-bundle", "-m", "spec.depth=16,10"])
    assert (args.command, args.step, args.rest) == (
        "run",
        "bench",
        ["serve=sglang-bundle", "-m", "spec.depth=16,10"],
    )
    argv, _, _ = bundle_run.step_command({"packs": []}, args.step, args.rest, Path("/h"))
    assert argv[1:] == ["-m", "eagle3.bench", "-m", "serve=sglang-bundle", "spec.depth=16,10"]
    args = bundle_run.parse(["--home", "/h", "run", "bench", "-m", "serve=x", "spec=off,d8"])
    assert (args.home, args.step, args.rest) == (
        Path("/h"),
        "bench",
        ["-m", "serve=x", "spec=off,d8"],
    )
    args = bundle_run.parse(["test", "-q", "-x", "tests/unit/test_fsdp.py"])
    assert (args.command, args.rest) == ("test", ["-q", "-x", "tests/unit/test_fsdp.py"])
    argv, env, _ = bundle_run.test_command({"packs": []}, args.rest, Path("/h"))
    assert argv[1:] == ["-m", "pytest", "-q", "-x", "tests/unit/test_fsdp.py"]


def test_a_code_change_rebuilds_only_the_source_pack(make_cfg, tmp_path):
    """The source travels as a pack of its own and packs are built the same from the same inputs:
    a bundle with the source and one without have the same wheel and file packs, so a code change
    re-sends the source's parts alone."""
    cfg, first, _ = make_bundle(make_cfg, tmp_path, "bundle.source=true", "bundle.part_mib=64")
    packs = {p["name"]: p["sha256"] for p in json.loads(first.read_text())["packs"]}
    assert sorted(packs) == ["assets", "base", "files", "source"]
    assets = json.loads(first.read_text())["packs"][[*packs].index("assets")]["members"]
    assert assets and all(m.startswith("source/assets/") for m in assets)
    again = built_bundle(make_cfg(*cfg_overrides(cfg, tmp_path / "again"), "bundle.source=false"))
    assert {p["name"]: p["sha256"] for p in json.loads(again.read_text())["packs"]} == {
        n: packs[n] for n in ("base", "files")
    }


def cfg_overrides(cfg, out: Path) -> list[str]:
    return [
        "target=tiny-llama",
        f"data.source={cfg.data.source}",
        f"bundle.out={out}",
        "bundle.packages=[]",
        f"bundle.wheel_dirs=[{cfg.bundle.wheel_dirs[0]}]",
        "bundle.part_mib=64",
    ]


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
    _, env, cwd = bundle_run.step_command(manifest, "bench", [], home)
    probe = "from eagle3.core.artifacts import git_commit; print(git_commit())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert done.stdout.strip() == git_commit() != "None", done.stderr
    assert sorted(p.name for p in manifest_path.parent.iterdir()) == sorted(
        [bundle_run.MANIFEST, "run.py", *(p["name"] for p in all_parts(manifest))]
    )

"""`python -m eagle3.tools.bundle`: everything a GPU machine without network needs to run a pipeline step,
in parts of a configured size: wheels of the packages it lacks, the target, the data and the drafter
the composed config names, and this repository's source. Beside the parts: manifest.json (every
part's sha256) and run.py, which joins, checks, installs and runs a step there with nothing but Python.

    python -m eagle3.tools.bundle experiment=smollm2-h200-turns3-sampled2 data.source=turns3s2.jsonl
    # copy bundle/ to the machine (whole, or a part at a time with manifest.json and run.py), then:
    python3 run.py run train experiment=smollm2-h200-turns3-sampled2 'data.source=${oc.env:BUNDLE_FILES}/turns3s2.jsonl'

Settings: conf/bundle/default.yaml (bundle.out, bundle.part_mib, bundle.packages, bundle.files, ...).
With 'bundle.engines=[sglang,vllm]' it also carries those serving engines (eagle3.tools.bundle_engines).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from eagle3.core.artifacts import COMMIT_FILE, git_commit
from eagle3.core.common import CONF_DIR, Eagle3Error, app, log
from eagle3.core.config import BundleConfig, Config, TargetConfig
from eagle3.tools import bundle_engines, bundle_run

REPO_ROOT = Path(CONF_DIR).parent


def installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        raise Eagle3Error(
            f"bundle.packages: {package} is not installed here, so its version is unknown"
        ) from None


def target_package(tcfg: TargetConfig) -> str | None:
    """The package the target is shipped in (target=gguf_package), else None."""
    return getattr(tcfg, "package", None) if tcfg.kind == "gguf_package" else None


def wanted_packages(bcfg: BundleConfig, tcfg: TargetConfig) -> list[str]:
    """bundle.packages, plus the package the target is shipped in."""
    packages = list(bcfg.packages)
    if target_package(tcfg):
        packages.append(str(target_package(tcfg)))
    return list(dict.fromkeys(packages))


def download_wheels(bcfg: BundleConfig, packages: list[str], into: Path) -> None:
    """A wheel per package at its installed version for the machine's Python and platforms; a
    package published without one is built here."""
    platforms = [arg for name in bcfg.platforms for arg in ("--platform", str(name))]
    for package in tqdm(packages, desc="wheels", unit="package"):
        pinned = f"{package}=={installed_version(package)}"
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into)]
        binary = ["--only-binary=:all:", "--python-version", str(bcfg.python_version)]
        done = subprocess.run([*download, *binary, *platforms, pinned], capture_output=True)
        if done.returncode != 0:
            build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into)]
            built = subprocess.run([*build, pinned], capture_output=True, text=True)
            if built.returncode != 0:
                raise Eagle3Error(f"bundle.packages: no wheel for {pinned}: {built.stderr[-300:]}")
    for folder in bcfg.wheel_dirs:
        for wheel in Path(str(folder)).glob("*.whl"):
            shutil.copy2(wheel, into / wheel.name)


def configured_files(named: list, bundle_files: list[str]) -> dict[str, Path]:
    """files/<name> -> path: the paths the config names (`named`: the data source, the drafter, the
    starting weights and a local target; those that exist here), and bundle.files."""
    files = {}
    for value in [*named, *bundle_files]:
        if value is None:
            continue
        path = Path(str(value)).expanduser()
        if path.exists():
            files[path.name] = path
        elif value in bundle_files:
            raise Eagle3Error(f"bundle.files: {value} does not exist")
    return files


def source_files() -> list[str]:
    """The repository's tracked files that exist in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [name for name in listed.split("\0") if name and (REPO_ROOT / name).exists()]


def packs(
    bcfg: BundleConfig,
    target_package: str | None,
    files: dict[str, Path],
    wheels: Path,
    base_wheels: list[Path],
    engines: dict,
) -> dict[str, dict[str, Path]]:
    """Pack name -> {name in the pack: path here}. Each pack travels in parts of its own, so a
    change re-sends only its pack: `source` (this repository's tracked files), `assets` (its shipped
    drafter and answer logs), `files`, `base` (the packages the machine lacks), `target` (the
    package the target is shipped in), and one per engine (`engine-sglang`, ...)."""
    target_prefix = f"{str(target_package).replace('-', '_')}-" if target_package else None
    chosen: dict[str, dict[str, Path]] = {}
    for engine, done in engines.items():  # each engine has all its wheels (they go to its own site)
        chosen[f"engine-{engine}"] = {f"wheels/{w}": wheels / w for w in done["wheels"]}
    for wheel in sorted(base_wheels):
        pack = "target" if target_prefix and wheel.name.startswith(target_prefix) else "base"
        chosen.setdefault(pack, {})[f"wheels/{wheel.name}"] = wheel
    for name, path in files.items():
        chosen.setdefault("files", {})[f"files/{name}"] = path
    if bcfg.source:  # the shipped assets (drafter, answer logs) apart: they seldom change
        for name in source_files():
            pack = "assets" if name.startswith("assets/") else "source"
            chosen.setdefault(pack, {})[f"source/{name}"] = REPO_ROOT / name
        commit = wheels.parent / COMMIT_FILE  # the source has no history there: name its commit
        commit.write_text(f"{git_commit() or 'unknown'}\n")
        chosen["source"][f"source/{COMMIT_FILE}"] = commit
    return chosen


def pack(chosen: dict[str, Path], packed: Path) -> None:
    """A tar of `chosen` that depends on their names and contents only (no times or owners), so
    the same inputs give the same pack and parts."""

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    with tarfile.open(packed, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in tqdm(sorted(chosen.items()), desc=f"packing {packed.stem}", unit="file"):
            tar.add(path, arcname=name, filter=plain)


def split_parts(packed: Path, part_bytes: int) -> list[dict]:
    """packed.000, packed.001, ... of at most part_bytes each, with their sha256; packed removed."""
    parts = []
    with packed.open("rb") as whole:
        while chunk := whole.read(part_bytes):
            part = packed.with_name(f"{packed.name}.{len(parts):03d}")
            part.write_bytes(chunk)
            parts.append(
                {
                    "name": part.name,
                    "bytes": len(chunk),
                    "sha256": hashlib.sha256(chunk).hexdigest(),
                }
            )
    packed.unlink()
    return parts


def build(bcfg: BundleConfig, tcfg: TargetConfig, named: list) -> Path:
    """Write the bundle of target `tcfg` into bundle.out, with the files at the paths the config
    names (`named`: see configured_files); returns its manifest.json."""
    out = Path(str(bcfg.out))
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    download_wheels(bcfg, wanted_packages(bcfg, tcfg), wheels)
    base_wheels = list(wheels.glob("*.whl"))
    engines = bundle_engines.add_engines(bcfg, wheels) if bcfg.engines else {}
    part_bytes = max(1, int(float(bcfg.part_mib) * 2**20))
    manifest = {"packs": [], "engines": engines, "source": bool(bcfg.source)}
    files = configured_files(named, list(bcfg.files))
    chosen_packs = packs(bcfg, target_package(tcfg), files, wheels, base_wheels, engines)
    for name, chosen in chosen_packs.items():
        packed = out / f"{name}.tar"
        pack(chosen, packed)
        digest = bundle_run.sha256_of([packed])
        manifest["packs"].append(
            {
                "name": name,
                "sha256": digest,
                "members": sorted(chosen),
                "parts": split_parts(packed, part_bytes),
            }
        )
    shutil.rmtree(wheels)
    (out / COMMIT_FILE).unlink(missing_ok=True)
    (out / bundle_run.MANIFEST).write_text(json.dumps(manifest, indent=2))
    shutil.copy2(bundle_run.__file__, out / "run.py")
    return out / bundle_run.MANIFEST


@app
def main(cfg: Config) -> None:
    named = [cfg.data.source, cfg.drafter.path, cfg.train.init_from, cfg.target.path]
    manifest_path = build(cfg.bundle, cfg.target, named)
    manifest = json.loads(manifest_path.read_text())
    parts = [part for p in manifest["packs"] for part in p["parts"]]
    size = sum(part["bytes"] for part in parts) / 2**20
    log.info("bundle: %d parts, %.1f MiB", len(parts), size)
    print(f"bundle: {manifest_path.parent} ({len(parts)} parts, {size:.1f} MiB)")
    for p in manifest["packs"]:
        mib = sum(part["bytes"] for part in p["parts"]) / 2**20
        print(
            f"  {p['name']}: {len(p['members'])} members, {mib:.1f} MiB in {len(p['parts'])} parts"
        )
    for engine, done in manifest["engines"].items():
        trimmed = "; ".join(f"{w} without {len(d)} files" for w, d in done["trimmed"].items())
        print(f"  {engine}: {len(done['wheels'])} wheels, {done['mib']} MiB")
        print(f"    trimmed: {trimmed or 'nothing'}")
        kept = ", ".join(f"{n} ({why})" for n, why in done["kept_from_machine"].items())
        print(f"    kept at the machine's version: {kept or 'none'}")
        print(f"    left out: {', '.join(done['left_out']) or 'none'}")
    print(
        f"  on the machine: python3 run.py run <step> <overrides> (in {manifest_path.parent.name}/)"
    )


if __name__ == "__main__":
    main()

"""Install and run a pipeline step from a bundle (`python -m eagle3.tools.bundle`) on a machine without
network. Needs only Python (and torch, which the bundle does not hold). Written beside the parts as
run.py:

    python3 run.py install                     # gather, check and install the parts that are here
    python3 run.py run STEP [overrides...]     # then python -m eagle3.STEP (overrides and -m in any order)
    python3 run.py test [pytest args...]       # then the project's tests (python -m pytest)

The bundle is made of packs (source, files, base, target, engine-<name>), each in parts. Parts may
arrive over several copies: each command gathers the parts it finds beside run.py and in the folders
given with --parts into the home folder (--home, default /tmp/eagle3-bundle, which outlives one
command on the same machine), installs each pack whose parts are all there (its sha256 checked; once
per pack content, so a changed pack is installed again alone) and names the parts still missing. A
step runs once every pack but the engines' is installed; an engine pack not there yet is named. The
wheels of base and target go into HOME/site, an engine's into HOME/site-<engine> (the engines pin
different versions of the same packages; serve=<engine>-bundle puts its own first on the engine's
PYTHONPATH through EAGLE3_BUNDLE_SITE_<ENGINE>). A step runs in HOME/bundle/source with HOME/site and
the bundled source on PYTHONPATH (a bundle without source, bundle.source=false, runs the step in the
eagle3 checkout run.py is called from); BUNDLE_FILES names HOME/bundle/files
(`data.source=${oc.env:BUNDLE_FILES}/x`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
STEPS = ("data", "extract", "train", "export", "bench", "pipeline", "serve", "info", "study")
DEFAULT_HOME = "/tmp/eagle3-bundle"
ENGINE_PREFIX = "engine-"


class BundleError(Exception):
    pass


def sha256_of(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def gather(manifest: dict, sources: list[Path], home: Path) -> list[str]:
    """Copy every part found in `sources` (checked against its sha256) into HOME/parts; the names of
    the parts still missing."""
    parts = home / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in (part for p in manifest["packs"] for part in p["parts"]):
        kept = parts / part["name"]
        if kept.exists() and kept.stat().st_size == part["bytes"]:
            continue
        found = [s / part["name"] for s in sources if (s / part["name"]).exists()]
        if not found:
            missing.append(part["name"])
            continue
        if sha256_of([found[0]]) != part["sha256"]:
            raise BundleError(f"{found[0]}: its sha256 is not the manifest's (a damaged copy)")
        shutil.copyfile(found[0], kept)
    return missing


def site_of(pack: str, home: Path) -> Path:
    if pack.startswith(ENGINE_PREFIX):
        return home / f"site-{pack.removeprefix(ENGINE_PREFIX)}"
    return home / "site"


def install_pack(pack: dict, home: Path) -> None:
    """Join a pack's parts, check the whole, unpack it into HOME/bundle and install its wheels; once
    per pack content (HOME/installed/<pack> holds its sha256)."""
    marker = home / "installed" / pack["name"]
    if marker.exists() and marker.read_text() == pack["sha256"]:
        return
    parts = [home / "parts" / p["name"] for p in pack["parts"]]
    if sha256_of(parts) != pack["sha256"]:
        raise BundleError(
            f"pack {pack['name']}: the joined parts do not match the manifest's sha256"
        )
    unpacked = home / "bundle"
    if pack["name"] == "source":  # a new source replaces the old (the assets pack stays)
        for old in (unpacked / "source").glob("*"):
            if old.name != "assets":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    unpacked.mkdir(parents=True, exist_ok=True)
    joined = home / f"{pack['name']}.tar"
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(joined) as tar:
        names = tar.getnames()
        tar.extractall(unpacked, filter="tar")
    joined.unlink()
    wheels = [unpacked / n for n in names if n.startswith("wheels/") and n.endswith(".whl")]
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--no-compile", "--upgrade", "--target", str(site_of(pack["name"], home))]
        subprocess.run([*pip, *map(str, wheels)], check=True)
        for wheel in wheels:
            wheel.unlink()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(pack["sha256"])


def install(manifest: dict, home: Path) -> list[str]:
    """Install every pack whose parts are all in HOME/parts; the names of the packs not complete."""
    waiting = []
    for pack in manifest["packs"]:
        if all((home / "parts" / p["name"]).exists() for p in pack["parts"]):
            install_pack(pack, home)
        else:
            waiting.append(pack["name"])
    return waiting


def step_env(manifest: dict, home: Path, source: Path) -> dict:
    paths = [str(home / "site"), str(source / "src"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "BUNDLE_FILES": str(home / "bundle" / "files"),
    }
    for pack in manifest["packs"]:
        if pack["name"].startswith(ENGINE_PREFIX):
            engine = pack["name"].removeprefix(ENGINE_PREFIX)
            env[f"EAGLE3_BUNDLE_SITE_{engine.upper()}"] = str(site_of(pack["name"], home))
    return env


def source_folder(home: Path) -> Path:
    source = home / "bundle" / "source"
    return source if source.is_dir() else Path.cwd()  # bundle.source=false: this checkout


def step_command(manifest: dict, step: str, overrides: list[str], home: Path):
    """(argv, environment, working folder) that run a pipeline step from the installed bundle."""
    if step not in STEPS:
        raise BundleError(f"unknown step {step!r}: one of {', '.join(STEPS)}")
    source = source_folder(home)
    argv = [sys.executable, "-m", f"eagle3.{step}", *hydra_order(overrides)]
    return argv, step_env(manifest, home, source), source


def hydra_order(overrides: list[str]) -> list[str]:
    """Hydra's flags (-m, --multirun) before the overrides: Hydra's parser takes no override
    before a flag (`bench serve=x -m spec=d4,d8` would be refused)."""
    flags = [a for a in overrides if a in ("-m", "--multirun")]
    return flags + [a for a in overrides if a not in flags]


def test_command(manifest: dict, args: list[str], home: Path):
    """(argv, environment, working folder) that run the project's tests with pytest."""
    source = source_folder(home)
    return [sys.executable, "-m", "pytest", *args], step_env(manifest, home, source), source


def parse(argv: list[str]) -> argparse.Namespace:
    """--home/--parts before the command; after `run STEP` or `test`, every argument is the step's
    (Hydra's -m included, in any order)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--home", type=Path, default=Path(DEFAULT_HOME))
    parser.add_argument("--parts", type=Path, action="append", default=[], help="a folder of parts")
    parser.add_argument("command", choices=("install", "run", "test"))
    commands = {"install", "run", "test"}
    at = next((i for i, a in enumerate(argv) if a in commands), len(argv))
    args = parser.parse_args(argv[: at + 1])
    rest = argv[at + 1 :]
    args.step, args.rest = (rest[0], rest[1:]) if args.command == "run" and rest else (None, rest)
    if args.command == "run" and args.step is None:
        parser.error(f"run needs a step: one of {', '.join(STEPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    here = Path(__file__).resolve().parent
    manifest = json.loads((here / MANIFEST).read_text())
    try:
        missing = gather(manifest, [here, *args.parts], args.home)
        waiting = install(manifest, args.home)
        if missing:
            print(f"bundle: {len(missing)} parts still missing: {', '.join(missing)}")
        needed = [p for p in waiting if not p.startswith(ENGINE_PREFIX)]
        if args.command == "install" or needed:
            if not waiting:
                print(f"bundle installed in {args.home}")
            return 3 if waiting else 0
        if waiting:
            print(f"bundle: not installed yet (parts missing): {', '.join(waiting)}")
        if args.command == "test":
            command, env, cwd = test_command(manifest, args.rest, args.home)
        else:
            command, env, cwd = step_command(manifest, args.step, args.rest, args.home)
        sys.stdout.flush()
        os.chdir(cwd)
        os.execvpe(command[0], command, env)  # the step replaces run.py: signals reach it directly
    except BundleError as err:
        print(f"bundle error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

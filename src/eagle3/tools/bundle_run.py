"""Install and run a pipeline step from a bundle (`python -m eagle3.tools.bundle`) on a machine without
network. Needs only Python (and torch, which the bundle does not hold). Written beside the parts as
run.py:

    python3 run.py install                     # gather, check and install the parts
    python3 run.py run STEP [overrides...]     # install if needed, then python -m eagle3.STEP

Parts may arrive over several copies: each command gathers the parts it finds beside run.py and in
the folders given with --parts into the home folder (--home, default /tmp/eagle3-bundle, which
outlives one command on the same machine), names the parts still missing, and installs once all are
there: the joined archive's sha256 is checked, the wheels installed into HOME/site, the source and
files unpacked into HOME/bundle. A step runs in HOME/bundle/source with HOME/site and the bundled
source on PYTHONPATH (a bundle without source, bundle.source=false, runs the step in the eagle3 checkout
run.py is called from); BUNDLE_FILES names HOME/bundle/files (`data.source=${oc.env:BUNDLE_FILES}/x`).
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
    for part in manifest["parts"]:
        kept = parts / part["name"]
        if kept.exists() and sha256_of([kept]) == part["sha256"]:
            continue
        found = [s / part["name"] for s in sources if (s / part["name"]).exists()]
        if not found:
            missing.append(part["name"])
            continue
        if sha256_of([found[0]]) != part["sha256"]:
            raise BundleError(f"{found[0]}: its sha256 is not the manifest's (a damaged copy)")
        shutil.copyfile(found[0], kept)
    return missing


def install(manifest: dict, home: Path) -> Path:
    """Join the gathered parts, check the whole, unpack it to HOME/bundle and install its wheels into
    HOME/site; once per bundle (HOME/installed holds the bundle's sha256)."""
    marker = home / "installed"
    if marker.exists() and marker.read_text() == manifest["sha256"]:
        return home / "bundle"
    parts = [home / "parts" / p["name"] for p in manifest["parts"]]
    if sha256_of(parts) != manifest["sha256"]:
        raise BundleError("the joined parts do not match the manifest's sha256")
    unpacked = home / "bundle"
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir(parents=True)
    joined = home / manifest["packed"]
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(joined) as tar:
        tar.extractall(unpacked, filter="tar")
    joined.unlink()
    wheels = sorted((unpacked / "wheels").glob("*.whl"))
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--no-compile", "--upgrade", "--target", str(home / "site"), *map(str, wheels)]
        subprocess.run(pip, check=True)
    marker.write_text(manifest["sha256"])
    return unpacked


def step_command(step: str, overrides: list[str], home: Path) -> tuple[list[str], dict, Path]:
    """(argv, environment, working folder) that run a pipeline step from the installed bundle."""
    if step not in STEPS:
        raise BundleError(f"unknown step {step!r}: one of {', '.join(STEPS)}")
    source = home / "bundle" / "source"
    if not source.is_dir():  # a bundle built with bundle.source=false: run in this checkout
        source = Path.cwd()
    paths = [str(home / "site"), str(source / "src"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "BUNDLE_FILES": str(home / "bundle" / "files"),
    }
    return [sys.executable, "-m", f"eagle3.{step}", *overrides], env, source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--home", type=Path, default=Path(DEFAULT_HOME))
    parser.add_argument("--parts", type=Path, action="append", default=[], help="a folder of parts")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="gather, check and install the parts")
    run = commands.add_parser("run", help="install if needed, then run a pipeline step")
    run.add_argument("step", choices=STEPS)
    run.add_argument("overrides", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent
    manifest = json.loads((here / MANIFEST).read_text())
    try:
        missing = gather(manifest, [here, *args.parts], args.home)
        if missing:
            print(f"bundle: {len(missing)} parts still missing: {', '.join(missing)}")
            return 3
        install(manifest, args.home)
        if args.command == "install":
            print(f"bundle installed in {args.home}")
            return 0
        command, env, cwd = step_command(args.step, args.overrides, args.home)
        sys.stdout.flush()
        os.chdir(cwd)
        os.execvpe(command[0], command, env)  # the step replaces run.py: signals reach it directly
    except BundleError as err:
        print(f"bundle error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The serving engines a bundle carries (`python -m eagle3.tools.bundle 'bundle.engines=[sglang,vllm]'`).

For each engine named in bundle.engines, conf/bundle/default.yaml's bundle.engine_sets.<engine>
gives the requirements (the engine and its kernel packages, pinned), the packages whose machine
version is kept although the engine pins another, the packages left out (features the launch
flags switch off), and the files trimmed from a wheel. The GPU machine's own package list
(bundle.machine_packages: `pip list --format=json` or `pip freeze` output from it) says what is
already there, so the bundle holds only what the machine lacks:

- resolution walks the requirements' wheel metadata (Requires-Dist), evaluated for the machine's
  Python and platform; a requirement the machine satisfies is not carried, one it does not satisfy
  is an error naming both versions (unless the package is in `keep`);
- each wheel needed is downloaded for the machine's Python and platform (bundle.python_version,
  bundle.platforms) with pip, one package at a time (--no-deps);
- trimming drops the configured files from a wheel (kernels for other GPU architectures, kernels
  of a backend the launch flags do not use) and rewrites its RECORD so pip installs it and the
  installed RECORD lists only files that exist. A rule that matches nothing is an error: the
  wheel's layout changed and the rule must be looked at again.

The wheels join the bundle's other wheels; run.py installs them all.
"""

from __future__ import annotations

import base64
import csv
import email.parser
import fnmatch
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from eagle3.core.common import CONF_DIR, Eagle3Error, log
from eagle3.core.config import BundleConfig

REPO_ROOT = Path(CONF_DIR).parent


# ---------------------------------------------------------------- the machine's packages


def read_machine_packages(path: Path) -> dict[str, str | None]:
    """Canonical name -> version from `pip list --format=json` or `pip freeze` output (a line with a
    name alone is a package known to be there at a version not recorded: None). Lines starting
    with # are comments."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        return {canonicalize_name(p["name"]): str(p["version"]) for p in json.loads(text)}
    packages: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not name.strip() or (_ and not version.strip()):
            raise Eagle3Error(f"{path}:{number}: {raw!r} is not `name==version` or `name`")
        packages[canonicalize_name(name.strip())] = version.strip() or None
    return packages


def marker_environment(bcfg: BundleConfig) -> dict[str, str]:
    """PEP 508 marker values of the machine (CPython on Linux x86_64 at bundle.python_version)."""
    version = str(bcfg.python_version)
    return {
        "python_version": ".".join(version.split(".")[:2]),
        "python_full_version": version if version.count(".") == 2 else f"{version}.0",
        "implementation_name": "cpython",
        "implementation_version": version if version.count(".") == 2 else f"{version}.0",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


# ---------------------------------------------------------------- resolution


@dataclass
class Resolved:
    """What one engine needs on the machine."""

    wheels: dict[str, Path] = field(default_factory=dict)  # canonical name -> downloaded wheel
    versions: dict[str, str] = field(default_factory=dict)  # canonical name -> version carried
    kept: dict[str, str] = field(default_factory=dict)  # name -> "machine X, wanted SPEC by Y"
    left_out: list[str] = field(default_factory=list)  # requirements not carried (left_out)


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) read from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(
            (n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")),
            None,
        )
        if name is None:
            raise Eagle3Error(f"{wheel}: no .dist-info/METADATA in it (not a wheel)")
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def requirement(text: str, where: str) -> Requirement:
    try:
        return Requirement(text)
    except InvalidRequirement as err:
        raise Eagle3Error(f"{where}: {text!r} is not a requirement ({err})") from None


class Conflict(Exception):
    """A requirement met after its package's version was chosen, which that version fails."""

    def __init__(self, req: Requirement, wanted_by: str, chosen: str):
        super().__init__(f"{wanted_by} requires {req}, but {chosen} was chosen for another")
        self.req = req


def resolve(
    requirements: list[str],
    machine: dict[str, str | None],
    keep: list[str],
    left_out: list[str],
    environment: dict[str, str],
    fetch,
    where: str,
) -> Resolved:
    """Walk the requirements and their wheels' Requires-Dist: `fetch(requirement text) -> wheel
    path` gets one wheel (the newest the specifier allows). A configured requirement also
    constrains the same package reached through another's metadata. A requirement that a version
    chosen earlier fails is learned and the walk starts again, choosing within every specifier
    learned so far; one that no version can meet is an error. `where` names the config key."""
    learned: dict[str, SpecifierSet] = {}
    fetched: dict[str, Path] = {}

    def fetch_once(text: str) -> Path:
        if text not in fetched:
            fetched[text] = fetch(text)
        return fetched[text]

    while True:
        try:
            return walk(
                requirements, machine, keep, left_out, environment, fetch_once, where, learned
            )
        except Conflict as conflict:
            name = canonicalize_name(conflict.req.name)
            before = learned.get(name, SpecifierSet())
            learned[name] = before & conflict.req.specifier
            if learned[name] == before:
                raise Eagle3Error(f"{where}: {conflict}: pin {name} in requirements") from None


def walk(requirements, machine, keep, left_out, environment, fetch, where, learned) -> Resolved:
    """One pass of resolve(); raises Conflict at the first requirement a chosen version fails."""
    pinned = {canonicalize_name(r.name): r for r in (requirement(t, where) for t in requirements)}
    kept_names = {canonicalize_name(n) for n in keep}
    left = {canonicalize_name(n) for n in left_out}
    resolved = Resolved()
    queue = [(r, "bundle config") for r in pinned.values()]
    while queue:
        req, wanted_by = queue.pop(0)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        if name in left:
            if name not in resolved.left_out:
                resolved.left_out.append(name)
            continue
        if name in machine:
            check_machine(req, wanted_by, machine[name], name in kept_names, resolved, where)
            continue
        if name in resolved.versions:
            if not req.specifier.contains(resolved.versions[name], prereleases=True):
                raise Conflict(req, wanted_by, f"{name} {resolved.versions[name]}")
            continue
        wanted = pinned.get(name, req)
        specifier = wanted.specifier & req.specifier & learned.get(name, SpecifierSet())
        wheel = fetch(f"{wanted.name}{specifier}")
        _, version, requires = wheel_metadata(wheel)
        resolved.wheels[name], resolved.versions[name] = wheel, version
        queue += [
            (requirement(line, f"{wheel.name} Requires-Dist"), f"{name} {version}")
            for line in requires
        ]
    return resolved


def check_machine(req, wanted_by, version, kept: bool, resolved: Resolved, where: str) -> None:
    """A requirement the machine already has: fine when its version fits (or is not recorded, or the
    package is kept at the machine's version); otherwise an error naming both."""
    name = canonicalize_name(req.name)
    if version is None or req.specifier.contains(version, prereleases=True):
        return
    if kept:
        resolved.kept[name] = f"machine {version}, {wanted_by} wants {req.specifier}"
        return
    raise Eagle3Error(
        f"{where}: {wanted_by} requires {req}, the machine has {name} {version}: add {name} to "
        f"keep (use the machine's, if the engine runs with it) or choose an engine version that "
        "accepts it"
    )


def pip_fetch(bcfg: BundleConfig, cache: Path):
    """fetch() for resolve(): one wheel for the machine's Python and platforms, no dependencies."""
    platforms = [arg for name in bcfg.platforms for arg in ("--platform", str(name))]

    def fetch(text: str) -> Path:
        with tempfile.TemporaryDirectory(dir=cache) as into:
            argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", into]
            argv += ["--only-binary=:all:", "--python-version", str(bcfg.python_version)]
            argv += [*platforms, *map(str, bcfg.engine_index_args), text]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise Eagle3Error(
                    f"bundle.engines: no wheel of {text} for Python {bcfg.python_version} on "
                    f"{', '.join(map(str, bcfg.platforms))}: {done.stderr.strip()[-400:]}"
                )
            (got,) = Path(into).glob("*.whl")
            kept = cache / got.name
            shutil.move(got, kept)
            return kept

    return fetch


# ---------------------------------------------------------------- trimming


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def trim_wheel(wheel: Path, patterns: list[str], where: str) -> list[str]:
    """Drop the files matching `patterns` (fnmatch on the path inside the wheel) from `wheel`, in
    place, and rewrite its RECORD without them; returns the dropped names. A pattern that matches
    nothing is an error (the wheel's layout changed)."""
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        unmatched = [p for p in patterns if not any(fnmatch.fnmatch(i.filename, p) for i in infos)]
        if unmatched:
            raise Eagle3Error(
                f"{where}: no file in {wheel.name} matches {', '.join(unmatched)}: the wheel's "
                "layout changed; look at its file list and update the rule"
            )
        dropped = [
            i.filename for i in infos if any(fnmatch.fnmatch(i.filename, p) for p in patterns)
        ]
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        trimmed = wheel.with_suffix(".trimming")
        with zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename in dropped:
                    continue
                data = z.read(info)
                if info.filename == record:
                    data = rewritten_record(data, set(dropped))
                out.writestr(info, data)
    trimmed.replace(wheel)
    return dropped


def rewritten_record(record: bytes, dropped: set[str]) -> bytes:
    """RECORD without the rows of dropped files (every other row as it was)."""
    rows = [
        row for row in csv.reader(io.StringIO(record.decode())) if row and row[0] not in dropped
    ]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue().encode()


# ---------------------------------------------------------------- the bundle step


def machine_list_path(bcfg: BundleConfig) -> Path:
    path = Path(str(bcfg.machine_packages)).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.exists():
        raise Eagle3Error(
            f"bundle.machine_packages: {path} does not exist (write it on the GPU machine with "
            "`python3 -m pip list --format=json > machine.json`)"
        )
    return path


def add_engines(bcfg: BundleConfig, wheels: Path) -> dict:
    """Resolve, download and trim each engine's wheels into `wheels`; what was done, per engine,
    for the bundle's manifest."""
    machine = read_machine_packages(machine_list_path(bcfg))
    environment = marker_environment(bcfg)
    downloads = wheels.parent / "engine-downloads"
    report = {}
    for engine in bcfg.engines:
        if engine not in bcfg.engine_sets:
            raise Eagle3Error(
                f"bundle.engines: {engine!r} has no bundle.engine_sets entry: one of "
                f"{', '.join(bcfg.engine_sets)}"
            )
        eset, where = bcfg.engine_sets[engine], f"bundle.engine_sets.{engine}"
        cache = downloads / engine  # an engine's trimmed wheel never replaces another's download
        cache.mkdir(parents=True, exist_ok=True)
        resolved = resolve(
            list(eset.requirements),
            machine,
            list(eset.keep),
            list(eset.left_out),
            environment,
            pip_fetch(bcfg, cache),
            where,
        )
        trimmed = {}
        for package, patterns in eset.trim.items():
            wheel = resolved.wheels.get(canonicalize_name(package))
            if wheel is None:
                raise Eagle3Error(f"{where}.trim: {package} is not among the wheels carried")
            trimmed[wheel.name] = trim_wheel(wheel, list(patterns), f"{where}.trim.{package}")
        for wheel in resolved.wheels.values():
            shutil.copy2(wheel, wheels / wheel.name)
        report[engine] = {
            "wheels": sorted(w.name for w in resolved.wheels.values()),
            "mib": round(sum(w.stat().st_size for w in resolved.wheels.values()) / 2**20, 1),
            "trimmed": trimmed,
            "kept_from_machine": resolved.kept,
            "left_out": resolved.left_out,
        }
        log.info(
            "bundle: %s needs %d wheels (%.1f MiB)",
            engine,
            len(resolved.wheels),
            report[engine]["mib"],
        )
    shutil.rmtree(downloads, ignore_errors=True)
    return report

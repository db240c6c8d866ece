"""The serving engines a bundle carries (`python -m eagle3.tools.bundle 'bundle.engines=[sglang,vllm]'`).

For each engine named in bundle.engines, conf/bundle/default.yaml's bundle.engine_sets.<engine>
gives the requirements (the engine and its kernel packages, pinned), the packages kept at the
machine's version although the engine pins another (each with why), the packages left out (each
with why: features the launch flags switch off), the files trimmed from a wheel, and the modules the
launch starts from. The GPU machine's own package list (bundle.machine_packages: `pip list
--format=json` or `pip freeze` output from it) says what is already there:

- resolution is uv's (`uv pip compile`, a backtracking resolver) for the machine's Python and
  newest manylinux tag, with the machine's packages as constraints (a version that runs beside
  them is chosen, an older one where the newest does not fit), `keep` as overrides and `left_out`
  as excludes; what the machine already has is not carried, the rest is downloaded from the lock
  with its sha256 checked;
- trimming drops the configured files from a wheel (kernels for other GPU architectures, kernels
  of a backend the launch flags do not use) and rewrites its RECORD so pip installs it and the
  installed RECORD lists only files that exist. A rule that matches nothing is an error: the
  wheel's layout changed and the rule must be looked at again;
- the import check walks what the launch modules import when they are imported (module level, not
  function bodies or imports guarded against ImportError) through the carried wheels: a module
  that neither the bundle, the machine nor the standard library has is an error naming the chain
  of imports that reaches it.

The wheels join the bundle's other wheels; run.py installs them all.
"""

from __future__ import annotations

import ast
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tomllib
from packaging.utils import canonicalize_name
from tqdm import tqdm

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


# ---------------------------------------------------------------- resolution


@dataclass
class Resolved:
    """What one engine needs on the machine."""

    wheels: dict[str, Path] = field(default_factory=dict)  # canonical name -> downloaded wheel
    versions: dict[str, str] = field(default_factory=dict)  # canonical name -> version carried
    kept: dict[str, str] = field(default_factory=dict)  # name -> "machine X: why"
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why it is not carried


@dataclass
class Locked:
    """One package of the resolver's lock: where its wheel for the machine is, and its sha256."""

    name: str
    version: str
    wheel: str  # a URL or a local path
    sha256: str | None


def base_version(version: str) -> str:
    """A version without its local part (torch 2.11.0+cu130 is 2.11.0 on an index)."""
    return version.split("+", 1)[0]


def resolver_platform(bcfg: BundleConfig) -> str:
    """uv's --python-platform for the newest manylinux tag in bundle.platforms (uv accepts every
    older tag too)."""
    tags = [re.fullmatch(r"manylinux_2_(\d+)_x86_64", str(p)) for p in bcfg.platforms]
    newest = max((int(t.group(1)) for t in tags if t), default=17)
    return f"x86_64-manylinux_2_{newest}"


def resolver_inputs(eset, machine: dict[str, str | None], folder: Path) -> list[str]:
    """The requirement, constraint, override and exclude files of one resolution: the machine's
    packages constrain it to their versions (so it backtracks to versions that run beside them),
    `keep` overrides an engine's pin with the machine's version (where the machine has the
    package), `left_out` is never resolved."""
    kept = [n for n in eset.keep if machine.get(canonicalize_name(n))]
    files = {
        "requirements.txt": list(map(str, eset.requirements)),
        "constraints.txt": [f"{n}=={base_version(v)}" for n, v in machine.items() if v],
        "overrides.txt": [f"{n}=={base_version(machine[canonicalize_name(n)])}" for n in kept],
        "excludes.txt": list(eset.left_out),
    }
    for name, lines in files.items():
        (folder / name).write_text("".join(f"{line}\n" for line in lines))
    argv = [str(folder / "requirements.txt"), "-c", str(folder / "constraints.txt")]
    argv += ["--overrides", str(folder / "overrides.txt")]
    return argv + ["--excludes", str(folder / "excludes.txt")]


def lock(bcfg: BundleConfig, eset, machine, folder: Path, where: str) -> list[Locked]:
    """Resolve with uv (a backtracking resolver) for the machine's Python and platform; the lock's
    packages with the wheel each one would install."""
    out = folder / "pylock.engine.toml"
    argv = [str(uv_binary()), "pip", "compile", "--quiet", "--no-header", "-o", str(out)]
    argv += ["--python-version", str(bcfg.python_version)]
    argv += ["--python-platform", resolver_platform(bcfg), "--only-binary", ":all:"]
    argv += [*resolver_inputs(eset, machine, folder), *map(str, bcfg.engine_index_args)]
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        why = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("warning"))
        raise Eagle3Error(f"{where}: no set of wheels fits the machine:\n{why.strip()}")
    packages = []
    for package in tomllib.loads(out.read_text()).get("packages", []):
        wheels = package.get("wheels") or []
        if not wheels:
            raise Eagle3Error(f"{where}: {package['name']} has no wheel for the machine")
        wheel = machine_wheel(wheels, list(map(str, bcfg.platforms)))
        packages.append(
            Locked(
                canonicalize_name(package["name"]),
                str(package["version"]),
                str(wheel.get("url") or wheel.get("path")),
                (wheel.get("hashes") or {}).get("sha256"),
            )
        )
    return packages


def machine_wheel(wheels: list[dict], platforms: list[str]) -> dict:
    """The wheel the machine's pip would pick among the lock's compatible ones: a platform wheel
    before a pure one (soundfile's manylinux wheel holds the libsndfile its pure one lacks), the
    earlier of `platforms` first."""

    def rank(wheel: dict) -> tuple[int, int]:
        name = str(wheel.get("url") or wheel.get("path")).rsplit("/", 1)[-1].split("#", 1)[0]
        tags = name.removesuffix(".whl").split("-")[-1].split(".")
        known = [platforms.index(t) for t in tags if t in platforms]
        return (tags == ["any"], min(known, default=len(platforms)))

    return min(wheels, key=rank)


def uv_binary() -> Path:
    import uv

    return Path(uv.find_uv_bin())


def resolve(bcfg: BundleConfig, eset, machine, scratch: Path, cache: Path, where: str) -> Resolved:
    """The wheels one engine needs that the machine lacks, downloaded into `cache`; the resolver's
    files are written to `scratch`."""
    resolved = Resolved(left_out={canonicalize_name(n): str(w) for n, w in eset.left_out.items()})
    for name, why in eset.keep.items():
        if machine.get(canonicalize_name(name)):  # a package the machine lacks is resolved as any
            resolved.kept[canonicalize_name(name)] = (
                f"machine {machine[canonicalize_name(name)]}: {why}"
            )
    for package in lock(bcfg, eset, machine, scratch, where):
        have = machine.get(package.name)
        if have is not None and base_version(have) == base_version(package.version):
            continue
        if package.name in machine and have is None:
            continue  # listed without a version: taken as it is
        resolved.wheels[package.name] = download(package, cache, where)
        resolved.versions[package.name] = package.version
    return resolved


def download(package: Locked, cache: Path, where: str) -> Path:
    """The locked wheel in `cache` (kept from an earlier bundle when its sha256 is the lock's)."""
    source = package.wheel.removeprefix("file://")
    name = source.rsplit("/", 1)[-1].split("#", 1)[0]
    kept = cache / name
    if kept.exists() and sha256_matches(kept, package.sha256):
        return kept
    partial = kept.with_suffix(".partial")
    if "://" in source:
        with httpx.stream("GET", source, follow_redirects=True, timeout=60) as response:
            response.raise_for_status()
            size = int(response.headers.get("content-length", 0)) or None
            bar = tqdm(total=size, desc=name[:40], unit="B", unit_scale=True, leave=False)
            with partial.open("wb") as f, bar:
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
    else:
        shutil.copyfile(source, partial)
    if not sha256_matches(partial, package.sha256):
        partial.unlink()
        raise Eagle3Error(f"{where}: {name}: its sha256 is not the lock's (a damaged download)")
    partial.replace(kept)
    return kept


def sha256_matches(path: Path, sha256: str | None) -> bool:
    return sha256 is None or hashlib.sha256(path.read_bytes()).hexdigest() == sha256


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


# ---------------------------------------------------------------- the launch path's imports


def wheel_modules(wheel: Path) -> dict[str, str | None]:
    """Dotted module name -> Python source (None: an extension module) of the files in a wheel."""
    modules: dict[str, str | None] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if ".dist-info" in parts[0] or ".data" in parts[0]:
                continue
            stem, _, suffix = parts[-1].partition(".")
            if parts[-1].endswith(".py"):
                dotted = parts[:-1] if stem == "__init__" else [*parts[:-1], stem]
                modules[".".join(dotted)] = z.read(name).decode(errors="replace")
            elif suffix.endswith("so"):
                modules[".".join([*parts[:-1], stem])] = None
    return modules


# exception names whose handler (or contextlib.suppress) covers a failed import
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def guards_import_errors(node: ast.Try) -> bool:
    """A try whose handlers catch a failed import (ImportError, ModuleNotFoundError, Exception, all)."""
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(getattr(t, "id", None) in IMPORT_ERRORS for t in types):
            return True
    return False


def suppresses_import_errors(node: ast.With) -> bool:
    """`with contextlib.suppress(ImportError)` (or ModuleNotFoundError, Exception): a guarded import."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call) and ast.unparse(call.func).split(".")[-1] == "suppress":
            if any(getattr(arg, "id", None) in IMPORT_ERRORS for arg in call.args):
                return True
    return False


def import_time_imports(body: list[ast.stmt], package: str) -> list[str]:
    """Modules a module body imports whatever the machine: module level, class and `with` bodies; not
    function bodies, imports under an `if` (a platform or feature switch, TYPE_CHECKING) or guarded
    against ImportError (a try, or `with suppress(ImportError)`). `package` resolves relative imports. `from a import b` yields a and a.b
    (b may be a submodule)."""
    found: list[str] = []
    for node in body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Try):
            if not guards_import_errors(node):
                found += import_time_imports(node.body + node.orelse, package)
            found += import_time_imports(node.finalbody, package)
        elif isinstance(node, ast.With):
            if not suppresses_import_errors(node):
                found += import_time_imports(node.body, package)
        elif isinstance(node, ast.ClassDef):
            found += import_time_imports(node.body, package)
    return found


def missing_imports(
    modules: dict[str, str | None], entries: list[str], elsewhere: set[str]
) -> dict[str, str]:
    """Walk the import-time imports from `entries` through `modules` (the carried wheels'); each
    top-level module imported that neither they, the standard library nor `elsewhere` (the
    machine's top-level modules) provide -> the first chain of imports that reaches it."""
    carried_tops = {name.split(".")[0] for name in modules}
    provided = carried_tops | elsewhere | set(sys.stdlib_module_names) | {"__main__"}
    packages = {name.rsplit(".", 1)[0] for name in modules if "." in name}
    chains: dict[str, str] = {entry: entry for entry in entries}
    queue, missing = list(entries), {}
    while queue:
        module = queue.pop(0)
        source = modules.get(module)
        if source is None:
            continue
        is_package = module in packages
        tree = ast.parse(source)
        for name in import_time_imports(
            tree.body, module if is_package else module.rpartition(".")[0]
        ):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                dotted = ".".join(parts[:depth])
                if dotted in chains:
                    continue
                chains[dotted] = f"{chains[module]} -> {dotted}"
                if parts[0] not in provided:
                    missing.setdefault(parts[0], chains[dotted])
                    break
                if dotted in modules:
                    queue.append(dotted)
    return missing


def check_launch_imports(wheels: list[Path], entries: list[str], elsewhere: set[str], where: str):
    """An error naming every module the engine's launch path imports that the bundle and the
    machine lack (a package left out that the launch needs, or a file trimmed that it loads)."""
    modules: dict[str, str | None] = {}
    for wheel in wheels:
        modules |= wheel_modules(wheel)
    absent = [e for e in entries if e not in modules]
    if absent:
        raise Eagle3Error(f"{where}.entry_modules: {', '.join(absent)} not in the carried wheels")
    missing = missing_imports(modules, entries, elsewhere)
    if missing:
        lines = "\n".join(f"  {name}: {chain}" for name, chain in sorted(missing.items()))
        raise Eagle3Error(
            f"{where}: the launch path imports modules neither the bundle nor the machine has "
            f"(bundle their package: take it out of left_out):\n{lines}"
        )


def machine_modules(bcfg: BundleConfig, machine: dict[str, str | None]) -> set[str]:
    """The machine's top-level modules: bundle.machine_modules (written on the machine) when given,
    else each package's name as a module name."""
    if bcfg.machine_modules:
        path = repo_path(str(bcfg.machine_modules))
        return set(json.loads(path.read_text()))
    return {name.replace("-", "_") for name in machine}


# ---------------------------------------------------------------- the bundle step


def repo_path(value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def machine_list_path(bcfg: BundleConfig) -> Path:
    path = repo_path(str(bcfg.machine_packages))
    if not path.exists():
        raise Eagle3Error(
            f"bundle.machine_packages: {path} does not exist (write it on the GPU machine with "
            "`python3 -m pip list --format=json > machine.json`)"
        )
    return path


def add_engines(bcfg: BundleConfig, wheels: Path) -> dict:
    """Resolve, download, trim and check each engine's wheels into `wheels` (which holds the
    bundle's other wheels already); what was done, per engine, for the bundle's manifest.
    Downloads are kept in bundle.download_cache."""
    machine = read_machine_packages(machine_list_path(bcfg))
    elsewhere = machine_modules(bcfg, machine)
    report = {}
    for engine in bcfg.engines:
        if engine not in bcfg.engine_sets:
            raise Eagle3Error(
                f"bundle.engines: {engine!r} has no bundle.engine_sets entry: one of "
                f"{', '.join(bcfg.engine_sets)}"
            )
        eset, where = bcfg.engine_sets[engine], f"bundle.engine_sets.{engine}"
        cache = Path(str(bcfg.download_cache)).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            resolved = resolve(bcfg, eset, machine, Path(scratch), cache, where)
        carried = {}
        for name, wheel in resolved.wheels.items():
            carried[name] = wheels / wheel.name
            shutil.copy2(wheel, carried[name])  # trimmed below: the cached download stays whole
        trimmed = {}
        for package, patterns in eset.trim.items():
            wheel = carried.get(canonicalize_name(package))
            if wheel is None:
                raise Eagle3Error(f"{where}.trim: {package} is not among the wheels carried")
            trimmed[wheel.name] = trim_wheel(wheel, list(patterns), f"{where}.trim.{package}")
        others = [w for w in wheels.glob("*.whl") if w not in carried.values()]  # eagle3's own
        check_launch_imports(
            [*others, *carried.values()], list(eset.entry_modules), elsewhere, where
        )
        report[engine] = {
            "wheels": sorted(w.name for w in carried.values()),
            "mib": round(sum(w.stat().st_size for w in carried.values()) / 2**20, 1),
            "trimmed": trimmed,
            "kept_from_machine": resolved.kept,
            "left_out": resolved.left_out,
        }
        log.info(
            "bundle: %s needs %d wheels (%.1f MiB)", engine, len(carried), report[engine]["mib"]
        )
    return report

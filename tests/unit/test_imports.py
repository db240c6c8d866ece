"""Imports run one way: every package's __init__ docstring says which eagle3 packages it may import
("May import: core, engine."), and every import of every module (module level and inside functions,
absolute and relative) keeps to it. docs/architecture.md's code map lists every package in an order
where each imports only those above it, with the declarations and commands the code has."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
from support import REPO

SRC = REPO / "src" / "eagle3"
ARCHITECTURE = REPO / "docs" / "architecture.md"
NOTHING = "no other eagle3 package"


def packages(src: Path) -> list[str]:
    return sorted(p.parent.name for p in src.glob("*/__init__.py"))


def declared(src: Path, package: str) -> set[str]:
    """The packages `package` may import, read from the "May import:" paragraph of its __init__
    docstring (remarks in parentheses and the final period left out)."""
    init = src / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    found = re.search(r"May import:(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    if found is None:
        raise AssertionError(f"{init}: the docstring has no 'May import:' line")
    text = re.sub(r"\([^)]*\)", "", " ".join(found.group(1).split())).strip().rstrip(".").strip()
    if text == NOTHING:
        return set()
    names = {name.strip() for name in text.split(",")}
    unknown = names - set(packages(src))
    if unknown:
        raise AssertionError(f"{init}: 'May import:' names no eagle3 package {sorted(unknown)}")
    return names


def imported_packages(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, package) of every eagle3 package that the module `module` (dotted, in file `path`)
    imports, wherever the import stands: `import eagle3.x.y`, `from eagle3.x import y`,
    `from eagle3 import x`, `from ..x import y`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                package = module.split(".")[:-1]
                here = package[: len(package) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            targets = (
                [f"{base}.{alias.name}" for alias in node.names] if base == "eagle3" else [base]
            )
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "eagle3" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def violations(src: Path) -> list[str]:
    """One line per import that its package's declaration does not allow."""
    known = set(packages(src))
    out = []
    for package in packages(src):
        allowed = declared(src, package) | {package}
        for path in sorted((src / package).rglob("*.py")):
            rel = path.relative_to(src.parent)
            module = ".".join(rel.with_suffix("").parts)
            for line, target in imported_packages(path, module):
                if target in known and target not in allowed:
                    may = ", ".join(sorted(allowed - {package})) or NOTHING
                    out.append(
                        f"{rel}:{line} imports eagle3.{target} ({package} may import: {may})"
                    )
    return out


def test_every_package_declares_what_it_may_import():
    """Every package has a declaration naming only eagle3 packages (declared() raises otherwise);
    core, the ground floor, imports none."""
    declarations = {package: declared(SRC, package) for package in packages(SRC)}
    assert {path.parent.name for path in SRC.glob("*/*.py")} == set(declarations)
    assert declarations["core"] == set()
    assert all(package not in may for package, may in declarations.items())


def test_every_import_is_one_its_package_may_make():
    assert violations(SRC) == []


def test_a_planted_import_is_flagged(tmp_path):
    """The checker on a copy of src/eagle3 with forbidden imports planted in three forms (module
    level absolute, inside a function, relative): it names each, and nothing else."""
    copy = tmp_path / "eagle3"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == []
    kv = copy / "engine" / "kv.py"
    kv.write_text(
        kv.read_text()
        + "\n\ndef planted():\n    from eagle3.train.ttt import unroll\n\n    return unroll\n"
    )
    lines = len(kv.read_text().splitlines())
    (copy / "core" / "planted.py").write_text(
        "import eagle3.bench.verdict\n\nfrom ..serve import launch\n"
    )
    assert violations(copy) == [
        "eagle3/core/planted.py:1 imports eagle3.bench (core may import: no other eagle3 package)",
        "eagle3/core/planted.py:3 imports eagle3.serve (core may import: no other eagle3 package)",
        f"eagle3/engine/kv.py:{lines - 2} imports eagle3.train (engine may import: core)",
    ]


def test_a_declaration_naming_no_package_is_refused(tmp_path):
    copy = tmp_path / "eagle3"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "engine" / "__init__.py"
    init.write_text(init.read_text().replace("May import: core.", "May import: core, engines."))
    with pytest.raises(
        AssertionError,
        match=r"engine/__init__.py: 'May import:' names no eagle3 package \['engines'\]",
    ):
        violations(copy)


def code_map() -> list[tuple[str, set[str], list[str]]]:
    """(package, may import, commands) per row of docs/architecture.md's code map, in order."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Code map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `"):
            continue
        package, _role, may, commands = cells
        may_import = set() if may == "—" else {m.strip(" `") for m in may.split(",")}
        rows.append((package.strip("`"), may_import, re.findall(r"`python -m ([\w.]+)`", commands)))
    return rows


def runnable(module: str) -> bool:
    path = REPO / "src" / Path(*module.split("."))
    if (path / "__main__.py").exists():
        return True
    file = path.with_suffix(".py")
    return file.exists() and '__name__ == "__main__"' in file.read_text()


def test_the_code_map_is_the_code():
    rows = code_map()
    assert sorted(row[0] for row in rows) == packages(SRC)  # every package, once
    above: set[str] = set()
    for package, may_import, commands in rows:
        assert may_import == declared(SRC, package), package
        assert may_import <= above, f"{package} may import a package below it"
        above.add(package)
        if (SRC / package / "__main__.py").exists():
            assert f"eagle3.{package}" in commands, package
        assert [c for c in commands if not runnable(c)] == [], package


def test_unit_test_folders_mirror_the_packages():
    """tests/unit/<package>/ holds the unit tests of eagle3.<package>."""
    unit = REPO / "tests" / "unit"
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert "engine" in folders and folders <= set(packages(SRC)), sorted(folders)

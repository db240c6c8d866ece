"""The serving engines in a bundle (eagle3.tools.bundle_engines): which wheels an engine needs given the GPU
machine's package list, the files trimmed from a kernel wheel and its RECORD, and run.py installing
the result.

The wheels here are small wheels written by the tests, served to real pip through --find-links: the
real ones are hundreds of MB (sglang-kernel 615 MB) and the test machine has no index to fetch them
from. They carry the names, versions, Requires-Dist and file layout that the resolution and the
trimming read.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import REPO, built_bundle

from eagle3.core.common import Eagle3Error
from eagle3.tools import bundle_run
from eagle3.tools.bundle_engines import (
    check_launch_imports,
    machine_wheel,
    read_machine_packages,
    resolve,
    trim_wheel,
)

# sgl_kernel's layout: per-architecture common ops, the FA3 kernels beside them
KERNEL_FILES = {
    "sgl_kernel/__init__.py": "ARCH = 'sm90'\n",
    "sgl_kernel/sm90/common_ops.abi3.so": "sm90 kernels",
    "sgl_kernel/sm100/common_ops.abi3.so": "sm100 kernels",
    "sgl_kernel/flash_ops.abi3.so": "fa3 kernels" * 100,
}


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(folder: Path, name: str, version: str, requires=(), files=None) -> Path:
    """A wheel pip installs: METADATA with Requires-Dist, WHEEL, the files and a RECORD with their
    sha256 (as a build backend writes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = dict(files or {f"{dist}/__init__.py": f"VERSION = '{version}'\n"})
    contents[f"{info}/METADATA"] = meta
    contents[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = io.StringIO()
    rows = [(n, record_hash(t.encode()), len(t.encode())) for n, t in contents.items()]
    csv.writer(record, lineterminator="\n").writerows([*rows, (f"{info}/RECORD", "", "")])
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, text in contents.items():
            z.writestr(n, text)
        z.writestr(f"{info}/RECORD", record.getvalue())
    return wheel


@pytest.fixture
def index(tmp_path) -> Path:
    """A find-links folder shaped like SGLang 0.5.14's wheel set as the GPU machine sees it."""
    folder = tmp_path / "index"
    write_wheel(
        folder,
        "sglang",
        "0.5.14",
        [
            "sglang-kernel==0.4.4",
            "flashinfer-python==0.6.12",
            "transformers==5.8.1",  # the machine keeps its 5.17.0 (bundle.engine_sets.sglang.keep)
            "torch==2.11.0",  # the machine has 2.11.0
            "xgrammar==0.1.25",  # left out: --grammar-backend none
            "orjson>=3.9",
            "aiohttp",  # on the machine
            'pywin32; sys_platform == "win32"',  # another platform's
            'pytest; extra == "test"',  # an extra nobody asked for
            'tomli; python_version < "3.11"',  # for an older Python than the machine's 3.12
        ],
        files={"sglang/__init__.py": "VERSION = '0.5.14'\n", "sglang/launch_server.py": LAUNCH},
    )
    write_wheel(folder, "sglang-kernel", "0.4.4", files=KERNEL_FILES)
    write_wheel(folder, "sglang-kernel", "0.4.5", files=KERNEL_FILES)  # newer, not the pin
    write_wheel(
        folder,
        "flashinfer-python",
        "0.6.12",
        ["apache-tvm-ffi>=0.1,<0.2", "torch", "flashinfer-cubin==0.6.12", "numpy"],
    )
    write_wheel(folder, "apache-tvm-ffi", "0.1.3")
    write_wheel(folder, "apache-tvm-ffi", "0.1.5")  # the newest the specifier allows
    write_wheel(folder, "apache-tvm-ffi", "0.2.0")
    # the newest orjson needs an aiohttp the machine does not have: the resolver backtracks to 3.9.0
    write_wheel(folder, "orjson", "3.9.0", ["aiohttp>=3"])
    write_wheel(folder, "orjson", "3.11.4", ["aiohttp>=4"])
    for name, version in [
        ("flashinfer-cubin", "0.6.12"),
        ("jsonschema", "4.26.0"),  # a configured requirement SGLang does not declare
        ("xgrammar", "0.1.25"),
        ("transformers", "5.8.1"),
        ("transformers", "5.17.0"),
        ("torch", "2.11.0"),
        ("aiohttp", "3.14.3"),
        ("aiohttp", "4.0.0"),
        ("numpy", "2.5.2"),
        ("numpy", "3.0.0"),
    ]:
        write_wheel(folder, name, version)
    return folder


# the launch module: module-level imports of carried and machine packages; the left-out xgrammar
# only behind a guard, under an `if` and inside a function (none of those run at import)
LAUNCH = """import contextlib
import json
import orjson
import sgl_kernel
from transformers import AutoConfig
try:
    import xgrammar
except ImportError:
    xgrammar = None
with contextlib.suppress(ImportError):
    import webcolors
if False:
    import xgrammar.compiler
def grammar():
    import xgrammar.kernels
"""

# suppress(KeyError) guards no import: fqdn is imported whatever the machine.
GRAMMAR = """import contextlib
import xgrammar
with contextlib.suppress(KeyError):
    import fqdn
backend = 1
"""

MACHINE = {"torch": "2.11.0", "transformers": "5.17.0", "aiohttp": "3.14.3", "numpy": "2.5.2"}
GPU_IMAGE = REPO / "conf/bundle/machines/gpu-image.json"


def machine_file(tmp_path, machine: dict) -> Path:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps([{"name": n, "version": v} for n, v in machine.items()]))
    return path


def sglang_resolution(make_cfg, index, tmp_path, machine):
    cfg = make_cfg(f"bundle.engine_index_args=[--no-index,--find-links,{index}]")
    cache = tmp_path / "downloads"
    cache.mkdir(exist_ok=True)
    (tmp_path / "scratch").mkdir(exist_ok=True)
    eset = cfg.bundle.engine_sets["sglang"]
    return resolve(
        cfg.bundle, eset, machine, tmp_path / "scratch", cache, "bundle.engine_sets.sglang"
    )


def test_an_engine_needs_what_the_machine_lacks_at_versions_that_fit_it(make_cfg, index, tmp_path):
    """The configured SGLang set against a machine: exactly the engine wheels plus the dependencies
    the machine lacks; orjson backtracked to the version whose aiohttp pin the machine meets; nothing
    the machine has, nothing for another platform, Python or extra, nothing left out; transformers
    kept at the machine's version with its reason."""
    resolved = sglang_resolution(make_cfg, index, tmp_path, MACHINE)
    assert resolved.versions == {
        "sglang": "0.5.14",
        "sglang-kernel": "0.4.4",
        "flashinfer-python": "0.6.12",
        "apache-tvm-ffi": "0.1.5",
        "jsonschema": "4.26.0",
        "orjson": "3.9.0",
    }
    assert resolved.wheels["sglang-kernel"].name == "sglang_kernel-0.4.4-py3-none-any.whl"
    assert resolved.kept["transformers"].startswith("machine 5.17.0: SGLang's pin 5.8.1 fails")
    assert {"xgrammar", "flashinfer-cubin"} <= set(resolved.left_out)


def test_a_machine_version_the_engine_refuses_is_named(make_cfg, index, tmp_path):
    machine = {**MACHINE, "torch": "2.10.0"}
    with pytest.raises(Eagle3Error) as caught:
        sglang_resolution(make_cfg, index, tmp_path, machine)
    message = str(caught.value)
    assert message.startswith("bundle.engine_sets.sglang: no set of wheels fits the machine:")
    assert "torch==2.10.0" in message and "sglang==0.5.14" in message


def test_the_shipped_machine_list_is_the_gpu_image(make_cfg):
    cfg = make_cfg()
    assert cfg.bundle.machine_packages == "conf/bundle/machines/gpu-image.json"
    machine = read_machine_packages(GPU_IMAGE)
    assert (machine["torch"], machine["transformers"], machine["numpy"]) == (
        "2.11.0",
        "5.17.0",
        "2.5.2",
    )
    assert len(machine) == 197 and "sglang" not in machine and "vllm" not in machine


def test_machine_package_lists_in_both_formats(tmp_path):
    frozen = tmp_path / "freeze.txt"
    frozen.write_text("# header\nTorch==2.11.0+cu130\nhuggingface_hub==1.33.0\naiohttp\n")
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"name": "Torch", "version": "2.11.0+cu130"}]))
    assert read_machine_packages(frozen) == {
        "torch": "2.11.0+cu130",
        "huggingface-hub": "1.33.0",
        "aiohttp": None,
    }
    assert read_machine_packages(listed) == {"torch": "2.11.0+cu130"}
    frozen.write_text("torch==\n")
    with pytest.raises(Eagle3Error, match=r"freeze.txt:1: 'torch==' is not `name==version`"):
        read_machine_packages(frozen)


def test_the_import_check_names_a_left_out_package_the_launch_imports(tmp_path):
    """Module-level imports are followed through the carried wheels; guarded (try/except ImportError,
    `with suppress(ImportError)`), conditional and function-level imports are not; a package neither carried, on the machine nor in the standard
    library is named with the chain of imports that reaches it."""
    carried = [
        write_wheel(
            tmp_path / "w",
            "sglang",
            "0.5.14",
            files={"sglang/__init__.py": "", "sglang/launch_server.py": LAUNCH},
        ),
        write_wheel(tmp_path / "w", "orjson", "3.9.0"),
        write_wheel(tmp_path / "w", "sglang-kernel", "0.4.4", files=KERNEL_FILES),
    ]
    machine = {"transformers", "torch"}
    check_launch_imports(carried, ["sglang.launch_server"], machine, "engine")  # nothing missing
    server = "import sglang.srt.server\n"
    carried.append(
        write_wheel(
            tmp_path / "w2",
            "sglang",
            "0.5.14",
            files={
                "sglang/launch_server.py": server,
                "sglang/srt/__init__.py": "",
                "sglang/srt/server.py": "from .grammar import backend\n",
                "sglang/srt/grammar.py": GRAMMAR,
            },
        )
    )
    with pytest.raises(Eagle3Error) as caught:
        check_launch_imports(carried[1:], ["sglang.launch_server"], machine, "engine")
    assert str(caught.value).splitlines()[1:] == [
        "  fqdn: sglang.launch_server -> sglang.srt.server -> sglang.srt.grammar -> fqdn",
        "  xgrammar: sglang.launch_server -> sglang.srt.server -> sglang.srt.grammar -> xgrammar",
    ]
    with pytest.raises(Eagle3Error, match=r"engine.entry_modules: sglang.serve not in the carried"):
        check_launch_imports(carried, ["sglang.serve"], machine, "engine")


def installed_record(site: Path, dist_info: str) -> list[list[str]]:
    return list(csv.reader((site / dist_info / "RECORD").read_text().splitlines()))


def test_trimming_drops_the_configured_files_and_pip_installs_the_rest(make_cfg, tmp_path):
    """The configured rule for sglang-kernel on an sm90 machine: flash_ops and sm100/ dropped, sm90
    kept; real pip installs the trimmed wheel and its installed RECORD lists exactly the files that
    are there, each with its right hash."""
    cfg = make_cfg()
    wheel = write_wheel(tmp_path / "w", "sglang-kernel", "0.4.4", files=KERNEL_FILES)
    rule = list(cfg.bundle.engine_sets["sglang"].trim["sglang-kernel"])
    dropped = trim_wheel(wheel, rule, "trim")
    assert sorted(dropped) == [
        "sgl_kernel/flash_ops.abi3.so",
        "sgl_kernel/sm100/common_ops.abi3.so",
    ]
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target"]
    subprocess.run([*pip, str(site), str(wheel)], check=True, capture_output=True)
    assert (site / "sgl_kernel/sm90/common_ops.abi3.so").read_text() == "sm90 kernels"
    assert not (site / "sgl_kernel/flash_ops.abi3.so").exists()
    assert not (site / "sgl_kernel/sm100").exists()
    rows = installed_record(site, "sglang_kernel-0.4.4.dist-info")
    listed = {row[0] for row in rows}
    assert {"sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so"} <= listed
    assert not listed & set(dropped)
    for path, digest, _ in rows:
        if digest:  # RECORD lists itself (and pip's own INSTALLER, REQUESTED) with no hash
            assert record_hash((site / path).read_bytes()) == digest, path


def test_a_trim_rule_that_matches_nothing_is_an_error(tmp_path):
    wheel = write_wheel(tmp_path / "w", "sglang-kernel", "0.4.4", files=KERNEL_FILES)
    before = wheel.read_bytes()
    with pytest.raises(
        Eagle3Error,
        match=r"no file in sglang_kernel-0.4.4-py3-none-any.whl matches sgl_kernel/sm80/\*",
    ):
        trim_wheel(wheel, ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm80/*"], "trim")
    assert wheel.read_bytes() == before


def test_a_bundle_with_sglang_installs_the_trimmed_engine(make_cfg, index, tmp_path):
    """python -m eagle3.tools.bundle 'bundle.engines=[sglang]': the engine's wheels are a pack of
    their own, the manifest says what was carried and trimmed, and run.py installs them into the
    engine's own site folder."""
    cfg = make_cfg(
        "target=tiny-llama",
        f"bundle.out={tmp_path / 'bundle'}",
        "bundle.packages=[]",
        "bundle.source=false",
        "bundle.part_mib=0.004",
        "bundle.engines=[sglang]",
        f"bundle.machine_packages={machine_file(tmp_path, MACHINE)}",
        f"bundle.download_cache={tmp_path / 'cache'}",
        f"bundle.engine_index_args=[--no-index,--find-links,{index}]",
        "bundle.engine_sets.sglang.entry_modules=[sglang.launch_server]",
    )
    manifest_path = built_bundle(cfg)
    manifest = json.loads(manifest_path.read_text())
    carried = manifest["engines"]["sglang"]
    assert carried["wheels"] == [
        "apache_tvm_ffi-0.1.5-py3-none-any.whl",
        "flashinfer_python-0.6.12-py3-none-any.whl",
        "jsonschema-4.26.0-py3-none-any.whl",
        "orjson-3.9.0-py3-none-any.whl",
        "sglang-0.5.14-py3-none-any.whl",
        "sglang_kernel-0.4.4-py3-none-any.whl",
    ]
    (pack,) = [p for p in manifest["packs"] if p["name"] == "engine-sglang"]
    assert pack["members"] == [f"wheels/{w}" for w in carried["wheels"]]
    assert carried["trimmed"] == {
        "sglang_kernel-0.4.4-py3-none-any.whl": [
            "sgl_kernel/sm100/common_ops.abi3.so",
            "sgl_kernel/flash_ops.abi3.so",
        ]
    }
    home = tmp_path / "home"
    assert bundle_run.gather(manifest, [manifest_path.parent], home) == []
    assert bundle_run.install(manifest, home) == []
    site = home / "site-sglang"
    assert (site / "sglang/__init__.py").read_text() == "VERSION = '0.5.14'\n"
    assert (site / "sgl_kernel/sm90/common_ops.abi3.so").exists()
    assert not (site / "sgl_kernel/flash_ops.abi3.so").exists()
    env = bundle_run.step_env(manifest, home, Path.cwd())
    assert env["EAGLE3_BUNDLE_SITE_SGLANG"] == str(site)


def test_an_unknown_engine_is_named(make_cfg, tmp_path):
    cfg = make_cfg(
        f"bundle.out={tmp_path / 'bundle'}",
        "bundle.packages=[]",
        "bundle.source=false",
        "bundle.engines=[tgi]",
    )
    with pytest.raises(Eagle3Error, match="bundle.engines: 'tgi' has no bundle.engine_sets entry"):
        built_bundle(cfg)


def test_the_platform_wheel_is_carried_before_the_pure_one():
    """The lock lists every wheel of a package the machine could install; the bundle carries the
    one its pip would pick: soundfile's manylinux wheel (it holds libsndfile), not the pure one
    listed first."""
    url = "https://host/packages/{}"
    wheels = [
        {"url": url.format("soundfile-0.13.1-py2.py3-none-any.whl")},
        {"url": url.format("soundfile-0.13.1-py2.py3-none-manylinux_2_28_x86_64.whl")},
    ]
    platforms = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64"]
    assert machine_wheel(wheels, platforms) is wheels[1]
    numpy = [
        {"path": "numpy-2.5.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"},
        {"path": "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"},
    ]
    assert machine_wheel(numpy, platforms) is numpy[1]  # the newer manylinux of the list
    assert machine_wheel(wheels[:1], platforms) is wheels[0]

"""The drafter that ships with eagle3, and the int8 packing that lets a drafter export travel in
git (`python -m eagle3.export.shipped pack|unpack`).

serve / bench / pipeline use the shipped drafter (conf/shipped: where it lives, when it is chosen)
when drafter.path is null, no drafter was trained for the composed config and the target is the one
it was trained for, or when drafter.path=shipped. It is unpacked once into the artifacts as a stage
folder (`<artifacts>/shipped/<export hash>/`: manifest with its lineage, sglang/ in float32),
registered in the MLflow model registry beside the drafters a user trains, and announced in one line.

Packing stores every 2-D float tensor as int8 with one float32 scale per output row (absmax / 127:
each weight moves by at most half its row's step); the vocab map (d2t, t2d) and the norms are stored
exactly. A v32k drafter (24.5 M parameters, 96 MB in float32) packs into ~19 MB:

    python -m eagle3.export.shipped pack /tmp/e3/artifacts/export/4f658d4f4df1 --out-dir assets
    python -m eagle3.export.shipped unpack assets/drafter-4f658d4f4df1.tgz /tmp/e3/init/4f658d4f4df1
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load, save

from eagle3.core import tracking
from eagle3.core.artifacts import StageOutput
from eagle3.core.common import CONF_DIR, Eagle3Error, log
from eagle3.core.config import ExportConfig, ShippedConfig, TargetConfig, TrackingConfig
from eagle3.core.drafter_io import MODELS_URI
from eagle3.core.target import target_key
from eagle3.export.stage import registry_name

SCALE = ".int8_scale"
KEYWORD = "shipped"  # drafter.path=shipped picks the shipped drafter explicitly
STAGE = "shipped"
TAG = "shipped_drafter"  # model-version tag: the export hash of the shipped drafter it holds
announced: set[str] = set()  # one announcement per process (a sweep runs its jobs in one)


# ---------------------------------------------------------------- packing


def quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    packed = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            scale = (tensor.float().abs().amax(dim=1) / 127).clamp_min(
                torch.finfo(torch.float32).tiny
            )
            packed[name] = (tensor.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            packed[name + SCALE] = scale
        else:
            packed[name] = tensor
    return packed


def dequantize(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        name: tensor.float() * packed[name + SCALE][:, None] if name + SCALE in packed else tensor
        for name, tensor in packed.items()
        if not name.endswith(SCALE)
    }


def add_file(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    """mtime 0, no owner: the same export packs to the same bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    archive.addfile(info, io.BytesIO(data))


def pack(export: Path, out_dir: Path) -> Path:
    """An export folder -> <out_dir>/drafter-<export hash>.tgz (int8 weights, exact vocab map)."""
    manifest = (export / "manifest.json").read_bytes()
    sglang = export / "sglang"
    tensors = load((sglang / "model.safetensors").read_bytes())
    out = out_dir / f"drafter-{json.loads(manifest)['hash']}.tgz"
    with (
        open(out, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w") as archive,
    ):
        add_file(archive, "manifest.json", manifest)
        add_file(archive, "sglang/config.json", (sglang / "config.json").read_bytes())
        add_file(archive, "sglang/model.int8.safetensors", save(quantize(tensors)))
    return out


def read_asset(asset: Path) -> dict[str, bytes]:
    try:
        with tarfile.open(asset) as archive:
            return {
                m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()
            }
    except (OSError, tarfile.TarError) as err:
        raise Eagle3Error(f"{asset}: not a readable drafter asset ({err})") from None


def unpack(asset: Path, out: Path) -> Path:
    """Write the export folder `out` (what pack read, the weights within their int8 rounding)."""
    files = read_asset(asset)
    (out / "sglang").mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_bytes(files["manifest.json"])
    write_engine_folder(files, out / "sglang")
    return out


def write_engine_folder(files: dict[str, bytes], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_bytes(files["sglang/config.json"])
    tensors = dequantize(load(files["sglang/model.int8.safetensors"]))
    partial = folder / "model.safetensors.partial"
    partial.write_bytes(save(tensors, metadata={"format": "pt"}))
    partial.replace(folder / "model.safetensors")


# ---------------------------------------------------------------- the shipped drafter


def asset_path(shipped: ShippedConfig) -> Path:
    """shipped.asset; a relative path is taken from the eagle3 checkout."""
    path = Path(str(shipped.asset)).expanduser()
    path = path if path.is_absolute() else Path(CONF_DIR).parent / path
    if not path.is_file():
        raise Eagle3Error(f"shipped.asset={shipped.asset}: no such file ({path})")
    return path


def asset_manifest(asset: Path) -> dict:
    with tarfile.open(asset) as archive:
        return json.loads(archive.extractfile("manifest.json").read())


def fits_target(tcfg: TargetConfig, manifest: dict) -> bool:
    return manifest.get("recipe", {}).get("target") == target_key(tcfg)


def uses_shipped_drafter(
    drafter_path, shipped: ShippedConfig, tcfg: TargetConfig, exported: Callable[[], bool]
) -> bool:
    """Whether the drafter is the shipped one: asked for by name (drafter.path=shipped), or
    (shipped.use=auto) nothing else named, nothing trained (`exported()`: the composed config's
    export is complete) and the target is the shipped drafter's."""
    if drafter_path == KEYWORD:
        return True
    if drafter_path or shipped.use != "auto":
        return False
    if exported():
        return False
    return fits_target(tcfg, asset_manifest(asset_path(shipped)))


def shipped_output(artifacts: str, manifest: dict, asset: Path) -> StageOutput:
    """<artifacts>/shipped/<export hash>: named by the export it was packed from, its lineage
    (that export and its train stage) as upstream."""
    digest = hashlib.sha256(asset.read_bytes()).hexdigest()[:12]
    export_hash = manifest["hash"]
    return StageOutput(
        STAGE,
        export_hash,
        Path(artifacts) / STAGE / export_hash,
        {"asset": asset.name, "asset_sha256": digest},
        {"export": export_hash, **manifest.get("upstream", {})},
    )


def unpacked(shipped: ShippedConfig, tcfg: TargetConfig, artifacts: str) -> StageOutput:
    """The shipped drafter as a stage folder under `artifacts`, unpacked on first use."""
    asset = asset_path(shipped)
    manifest = asset_manifest(asset)
    if not fits_target(tcfg, manifest):
        raise Eagle3Error(
            f"the shipped drafter {manifest['hash']} was trained for target "
            f"{manifest.get('recipe', {}).get('target', {}).get('name')}, not {tcfg.name}: "
            "train one with `python -m eagle3.pipeline` or set drafter.path"
        )
    out = shipped_output(artifacts, manifest, asset)
    if out.complete and out.config == out.manifest().get("config"):
        return out
    out.start()
    write_engine_folder(read_asset(asset), out.path / "sglang")
    out.finish(
        {"tau_hat": manifest.get("counts", {}).get("tau_hat")},
        recipe=manifest.get("recipe"),
        export_manifest=manifest,
        note="int8-packed export, unpacked to float32 (each weight within half its row's step)",
    )
    log.debug("unpacked the shipped drafter %s to %s", out.hash, out.path)
    return out


def registered(
    tracking_cfg: TrackingConfig, name: str, target_name: str, out: StageOutput
) -> str | None:
    """models:/<name>/<version> of the shipped drafter in the configured store (registered once)."""
    if not tracking_cfg.enabled:
        return None
    client = tracking.client(tracking_cfg)
    if not client.search_registered_models(filter_string=f"name='{name}'"):
        client.create_registered_model(name, description=f"EAGLE-3 drafters for {target_name}")
    for version in client.search_model_versions(f"name='{name}'"):
        if version.tags.get(TAG) == out.hash:
            return f"{MODELS_URI}{name}/{version.version}"
    run = client.create_run(
        tracking.setup(tracking_cfg),
        run_name=f"shipped drafter {out.hash}",
        tags={"stage": STAGE, "artifact_hash": out.hash},
    )
    client.log_artifacts(run.info.run_id, str(out.path / "sglang"), "drafter/sglang")
    client.log_artifact(run.info.run_id, str(out.manifest_path))
    client.set_terminated(run.info.run_id, "FINISHED")
    recipe = out.manifest().get("recipe") or {}
    tags = {TAG: out.hash, "tau_hat": str(recipe.get("tau_hat"))}
    tags.update({f"recipe.{k}": str(v)[:5000] for k, v in tracking.flatten(recipe).items()})
    version = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id, tags=tags
    )
    log.debug("registered the shipped drafter %s as %s version %s", out.hash, name, version.version)
    return f"{MODELS_URI}{name}/{version.version}"


def shipped_drafter(
    shipped: ShippedConfig,
    tcfg: TargetConfig,
    artifacts: str,
    tracking_cfg: TrackingConfig,
    ecfg: ExportConfig,
) -> Path:
    """The shipped drafter's export folder (unpacked under `artifacts`, registered under the
    export's registry name), announced once per process."""
    out = unpacked(shipped, tcfg, artifacts)
    uri = registered(tracking_cfg, registry_name(ecfg, tcfg), tcfg.name, out)
    if out.hash not in announced:
        announced.add(out.hash)
        where = f" (registered as {uri})" if uri else ""
        print(
            f"using the shipped drafter {out.hash}; train your own with "
            f"`python -m eagle3.pipeline`{where}",
            flush=True,
        )
    return out.path


# ---------------------------------------------------------------- the command line


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3.export.shipped",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack", help="an export folder -> OUT_DIR/drafter-<hash>.tgz")
    packing.add_argument("export", type=Path)
    packing.add_argument("--out-dir", type=Path, default=Path("."))
    unpacking = verbs.add_parser("unpack", help="an asset -> an export folder")
    unpacking.add_argument("asset", type=Path)
    unpacking.add_argument("out", type=Path)
    args = parser.parse_args()
    print(pack(args.export, args.out_dir) if args.verb == "pack" else unpack(args.asset, args.out))


if __name__ == "__main__":
    main()

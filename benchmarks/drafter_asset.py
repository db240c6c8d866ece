"""Pack a drafter export into a small committed file, and unpack it again, so a trained drafter
outlives the session that trained it (only committed files reach the next checkout).

Every 2-D float tensor is stored as int8 with one float32 scale per output row (absmax / 127: each
weight moves by at most half its row's step); the vocab map (d2t, t2d) and the norms are stored
exactly. A v32k drafter (24.5 M parameters, 96 MB in float32) packs into ~19 MB, small enough to
travel with every device call beside a third of the SmolLM2 wheel. Unpacking writes an export folder
(manifest.json, sglang/config.json, sglang/model.safetensors in float32) that `train.init_from`,
benchmarks/e2e_bench.py --drafter and the engines take like the original:

    python benchmarks/drafter_asset.py pack /tmp/e3/artifacts/export/4f658d4f4df1   # -> benchmarks/assets/
    python benchmarks/drafter_asset.py unpack benchmarks/assets/drafter-4f658d4f4df1.tgz /tmp/e3/init/4f658d4f4df1
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load, save

ASSETS = Path(__file__).resolve().parent / "assets"
SCALE = ".int8_scale"


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
    info = tarfile.TarInfo(name)
    info.size, info.mode = (
        len(data),
        0o644,
    )  # mtime 0, no owner: the same export packs to the same bytes
    archive.addfile(info, io.BytesIO(data))


def pack(export: Path, out_dir: Path = ASSETS) -> Path:
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


def unpack(asset: Path, out: Path) -> Path:
    """Write the export folder `out` (what pack read, the weights within their int8 rounding)."""
    with tarfile.open(asset) as archive:
        files = {member.name: archive.extractfile(member).read() for member in archive.getmembers()}
    (out / "sglang").mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_bytes(files["manifest.json"])
    (out / "sglang" / "config.json").write_bytes(files["sglang/config.json"])
    tensors = dequantize(load(files["sglang/model.int8.safetensors"]))
    (out / "sglang" / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser(
        "pack", help="an export folder -> benchmarks/assets/drafter-<hash>.tgz"
    )
    packing.add_argument("export", type=Path)
    packing.add_argument("--out-dir", type=Path, default=ASSETS)
    unpacking = verbs.add_parser("unpack", help="an asset -> an export folder")
    unpacking.add_argument("asset", type=Path)
    unpacking.add_argument("out", type=Path)
    args = parser.parse_args()
    print(pack(args.export, args.out_dir) if args.verb == "pack" else unpack(args.asset, args.out))


if __name__ == "__main__":
    main()

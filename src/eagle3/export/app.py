"""`python -m eagle3.export`: exports the drafter the composed config trained (a no-op when it is
exported) and prints its engine folders and registered model. The stage itself is in stage.py."""

from __future__ import annotations

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.export.stage import run


@app
def main(cfg: Config) -> None:
    out = run(cfg)
    manifest = out.manifest()
    print(f"exported drafter: {out.path}")
    for name in manifest.get("counts", {}).get("folders", []):
        print(f"  {name}: {out.path / name}")
    if manifest.get("registered"):
        print(f"registered: {manifest['registered']}")


if __name__ == "__main__":
    main()

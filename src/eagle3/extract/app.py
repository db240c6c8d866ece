"""`python -m eagle3.extract`: builds the extract stage's shards (a no-op when they are complete,
resumed when some are) and prints their folder and counts. The stage itself is in stage.py."""

from __future__ import annotations

import json

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.extract.stage import run


@app
def main(cfg: Config) -> None:
    out = run(cfg)
    print(f"extract: {out.path}")
    print(json.dumps(out.manifest().get("counts", {}), indent=1))


if __name__ == "__main__":
    main()

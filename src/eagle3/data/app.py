"""`python -m eagle3.data`: builds the data stage's output (a no-op when it is complete) and prints
its folder and counts. The stage itself is in stage.py."""

from __future__ import annotations

import json

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.data.stage import run


@app
def main(cfg: Config) -> None:
    out = run(cfg)
    counts = out.manifest().get("counts", {})
    print(f"data: {out.path}")
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()

"""`python -m eagle3.train`: trains the drafter the composed config describes (a no-op when its
output is complete; one process per rank under DDP or SLURM) and prints its folder. The stage
itself is in stage.py."""

from __future__ import annotations

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.train.stage import run


@app
def main(cfg: Config) -> None:
    out = run(cfg)
    print(f"trained drafter: {out.path}")


if __name__ == "__main__":
    main()

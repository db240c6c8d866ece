"""Export the newest checkpoint of an unfinished training run (training cut by a time limit)
as an SGLang/vLLM drafter folder, so it can still be benchmarked:

    python benchmarks/ckpt_export.py TRAIN_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

from transformers import LlamaConfig

from eagle3.core.drafter import Eagle3Drafter
from eagle3.core.drafter_io import DRAFTER_CONFIG, export_sglang
from eagle3.train.app import drafter_weights

train_dir, out_dir, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
checkpoint = max(train_dir.glob("**/*.ckpt"), key=lambda p: p.stat().st_mtime)
if (train_dir / DRAFTER_CONFIG).exists():
    config = LlamaConfig.from_dict(json.loads((train_dir / DRAFTER_CONFIG).read_text()))
else:  # written at the end of training: rebuild it from the config the run used
    from eagle3.core.common import compose
    from eagle3.core.drafter import drafter_config
    from eagle3.core.target import default_aux_layer_ids, resolve_target_path

    cfg = compose(overrides)
    target_config = LlamaConfig.from_pretrained(
        resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    )
    config = drafter_config(
        target_config, cfg.drafter, default_aux_layer_ids(target_config.num_hidden_layers)
    )
drafter = Eagle3Drafter(config)
missing, unexpected = drafter.load_state_dict(drafter_weights(checkpoint), strict=False)
assert not unexpected and all(k.startswith("embed_tokens.") for k in missing), (missing, unexpected)
export_sglang(drafter, out_dir, {"checkpoint": str(checkpoint)}, "sglang", "bfloat16")
print(f"exported {checkpoint} -> {out_dir}")

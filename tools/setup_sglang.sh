#!/usr/bin/env bash
# Idempotent set-up of a small CPU-only SGLang virtualenv, used to parse and
# check SGLang launch arguments (not to serve: that needs a GPU box).
#
#   bash tools/setup_sglang.sh [VENV_DIR]    (default: <repo>/.venv-sglang)
#
# sglang's own requirements pull CUDA-only packages and a different torch, so
# it is installed with --no-deps next to the CPU torch and the few light
# packages that `from sglang.srt.server_args import prepare_server_args`
# actually imports (found one missing module at a time in a bare venv).  A marker file
# VENV/.eagle3-ready is written only after the import and a parse have been
# verified, so an interrupted install is redone on the next run.
#
# Environment overrides:
#   PYTHON          interpreter used to create the venv (default: python3.11)
#   SGLANG_VERSION  sglang version (default: 0.5.23)
#   TORCH_VERSION   torch version pinned for pip (default: 2.13.0, CPU build)
#   FORCE=1         reinstall even if the venv looks ready
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
MARKER="$VENV/.eagle3-ready"
STAMP="sglang==$SGLANG_VERSION torch==$TORCH_VERSION"

# Exactly what the import chain of sglang.srt.server_args needs (besides
# torch and sglang itself).  `ipython` provides the module IPython, `pillow`
# provides PIL, `pyzmq` provides zmq.
LIGHT_DEPS=(
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
    pydantic pyzmq tqdm ipython aiohttp triton
)

# shellcheck source=tools/cpu_venv.sh
source "$REPO_ROOT/tools/cpu_venv.sh"

log() { echo "[setup_sglang] $*" >&2; }

# Parses a composed EAGLE-3 launch command; prints nothing on success.
check_parse() {
    "$VENV/bin/python" - "$SGLANG_VERSION" <<'PY'
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1], version("sglang")
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args([
    "--model-path", "/nonexistent/target",
    "--speculative-algorithm", "EAGLE3",
    "--speculative-draft-model-path", "/nonexistent/draft",
    "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4",
    "--tp-size", "8",
    "--mem-fraction-static", "0.8",
    "--dtype", "bfloat16",
    "--cuda-graph-max-bs-decode", "8",
])
got = (sa.speculative_algorithm, sa.speculative_num_steps,
       sa.speculative_eagle_topk, sa.speculative_num_draft_tokens,
       sa.tp_size, sa.mem_fraction_static, sa.dtype,
       sa.cuda_graph_max_bs_decode)
assert got == ("EAGLE3", 3, 1, 4, 8, 0.8, "bfloat16", 8), got
PY
}

if venv_ready check_parse; then
    log "$VENV already has sglang==$SGLANG_VERSION; nothing to do"
    exit 0
fi

prepare_cpu_venv

log "installing torch==$TORCH_VERSION (cpu) and the light import deps"
"${PIP[@]}" install -c "$CONSTRAINTS" "torch==$TORCH_VERSION" "setuptools>=77.0.3" "${LIGHT_DEPS[@]}"
log "installing sglang==$SGLANG_VERSION --no-deps"
# pip prints a dependency-conflict notice here (sglang wants a newer torch
# and CUDA packages); that is expected with --no-deps.
"${PIP[@]}" install -c "$CONSTRAINTS" --no-deps "sglang==$SGLANG_VERSION"

log "verifying"
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda; print('torch', torch.__version__)"
check_parse
"$VENV/bin/python" -c "import sglang; print('sglang', sglang.__version__)"

finish_cpu_venv

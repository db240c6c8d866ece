# Sourced by tools/setup_vllm.sh and tools/setup_sglang.sh: what every CPU-only engine venv shares.
# The caller sets VENV, PYTHON, TORCH_VERSION, MARKER, STAMP and defines log().

# venv_ready CHECK...: the venv carries this STAMP in its ready marker and CHECK passes (FORCE=1 says no).
venv_ready() {
    [ "${FORCE:-0}" != 1 ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$STAMP" ] \
        && [ -x "$VENV/bin/python" ] && "$@" >/dev/null 2>&1
}

# prepare_cpu_venv: create $VENV (or reuse a half-made one), upgrade pip, and set PIP plus CONSTRAINTS,
# a pip constraints file pinning torch to the CPU build so no dependency can swap in a CUDA wheel.
prepare_cpu_venv() {
    START=$(date +%s)
    rm -f "$MARKER"
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating venv $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi
    PIP=("$VENV/bin/python" -m pip)
    "${PIP[@]}" install --quiet --upgrade pip
    CONSTRAINTS="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
}

# finish_cpu_venv: mark the venv ready (only after the caller verified it) and report time and size.
finish_cpu_venv() {
    echo "$STAMP" >"$MARKER"
    log "done in $(( $(date +%s) - START ))s; size $(du -sh "$VENV" | cut -f1)"
}

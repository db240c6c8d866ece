import os
import subprocess
import sys

import pytest
from support import REPO

from eagle3.core.common import Eagle3Error
from eagle3.pipeline.plan import check_plans, stage_plans


def run_pipeline(root, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "eagle3.pipeline", *overrides],
        capture_output=True,
        text=True,
        env={**os.environ, "EAGLE3_ROOT": str(root)},
        timeout=600,
    )


def test_kimi_dry_run_prints_a_valid_plan(test_root):
    """Composes the kimi-k2.5 preset, validates both bench jobs with SGLang's own parser, runs nothing."""
    proc = run_pipeline(test_root, "experiment=kimi-k2.5", "pipeline.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for stage in ("data", "extract", "train", "export", "bench"):
        assert f"] {stage}:" in out
    assert "--tp-size 8" in out and "--speculative-algorithm EAGLE3" in out
    assert (
        "--speculative-num-steps 15 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16"
        in out
    )
    assert (
        "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 10"
        in out
    )
    # regeneration through the SGLang server the data stage starts (no speculation)
    regen = next(line for line in out.splitlines() if "data regeneration starts" in line)
    assert "sglang.launch_server --model-path moonshotai/Kimi-K2.5" in regen
    assert "--tp-size 8" in regen and "--speculative" not in regen
    # CUDA graphs up to the 256 requests regeneration sends at once; the bench jobs keep serve's 8
    assert "--cuda-graph-max-bs-decode 256" in regen
    assert "--reasoning-parser kimi_k2" in regen  # Kimi-K2.5 thinks: the thinking comes apart
    assert "--cuda-graph-max-bs-decode 8" in out.split("data regeneration starts")[1]
    # hidden states from a vLLM server over 8 GPUs capturing the aux ids [2, 30, 58] and L = 61
    assert "/vllm serve moonshotai/Kimi-K2.5" in out
    assert "--tensor-parallel-size 8" in out and '"method": "extract_hidden_states"' in out
    assert '"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]' in out
    capture = next(line for line in out.splitlines() if "extract starts" in line)
    assert "--no-enable-chunked-prefill" in capture  # vLLM's extraction requires it
    # 4 x 7168 x 2 B + 5 B per token, over at most 100,000 x 4096 tokens
    assert "57.3 kB per token; at most 409,600,000 tokens" in out and "23.490 TB" in out
    # training on 4 GPUs goes to SLURM: the batch script submitit would submit (one task per GPU,
    # ranks from srun for Lightning's SLURM environment)
    train = out[out.index("] train:") : out.index("] export:")]
    assert "-m eagle3.train -m experiment=kimi-k2.5 hydra/launcher=submitit_slurm" in train
    for line in (
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --nodes=1",
        "#SBATCH --job-name=train",
        "#SBATCH --time=720",
        "#SBATCH --mem=480GB",
    ):
        assert line in train, line
    assert "srun --unbuffered" in train and "-m submitit.core._submit" in train
    bench = out[out.index("] bench:") :]
    assert "#SBATCH --gpus-per-node=8" in bench and "#SBATCH --ntasks-per-node=1" in bench
    # train and export read the target's head by name: the hub id must be downloaded first
    assert (
        f"target.path=moonshotai/Kimi-K2.5 is a hub id that is not downloaded here: download it "
        f"with `hf download moonshotai/Kimi-K2.5 --local-dir {test_root}/artifacts/targets/"
        f"kimi-k2.5` and set target.path={test_root}/artifacts/targets/kimi-k2.5" in out
    )
    assert out.rstrip().endswith(
        "plan valid: every stage fits its GPUs and one host process, and every bench job's spec "
        "and engine command passed validation; train and export need the target downloaded "
        "first (above)"
    )
    assert not (test_root / "multirun").exists() or not any(
        (test_root / "multirun").glob("pipeline-*/0")
    )
    assert_kimi_stage_plans(out)


def stage_block(out: str, stage: str, following: str) -> str:
    return out[out.index(f"] {stage}:") : out.index(f"] {following}:")]


def assert_kimi_stage_plans(out: str) -> None:
    """Kimi-K2.5's weights at their stored dtypes (int4 routed experts, bf16 rest: 594.2 GB), each
    stage's GPU memory per GPU against an H200's 141 GB, the target tensors one host process holds,
    the time from the measured rates; data, extract and export go to SLURM like training."""
    assert out.startswith("target kimi-k2.5 (594.2 GB of weights; one process holds 120 GB)")
    data = stage_block(out, "data", "extract")
    assert "-m eagle3.data -m experiment=kimi-k2.5 hydra/launcher=submitit_slurm" in data
    assert "#SBATCH --job-name=data" in data and "#SBATCH --gpus-per-node=8" in data
    # 594.2 / 8 = 74.3 of weights; the KV room left in SGLang's 0.85 of 141 GB; 15 % for activations
    assert (
        "GPU memory per GPU: weights 74.3 + KV cache 45.6 + activations 21.2 = 141.0 of 141 GB "
        "(KV 70.3 kB a token, MLA's latent: every rank holds all of it; room for 648,545 of "
        "1,048,576 tokens in flight" in data
    )
    assert "0.00 GB of the target (no target tensors)" in data
    assert "time: 214.81 h (204,800,000 tokens at 265 tok/s (scaled from 7,800 tok/s))" in data
    extract = stage_block(out, "extract", "train")
    assert "#SBATCH --job-name=extract" in extract and "#SBATCH --gpus-per-node=8" in extract
    assert "weights 74.3 + KV cache 4.6 + activations 14.1 = 93.0 of 141 GB" in extract
    assert "time: 11.10 h (409,600,000 tokens at 10,254 tok/s" in extract
    train = stage_block(out, "train", "export")
    assert (
        "states 18.2 + DDP buckets 4.6 + frozen embedding 4.7 + target head 7.0 + activations 15.8 "
        "= 50.3 of 141 GB (1,139.6 M trainable parameters, 4 rank(s), ddp)" in train
    )
    assert "4.70 GB of the target (embedding, head and final norm by name)" in train
    assert "longer than cluster.timeout_min=720" in train
    export = stage_block(out, "export", "bench")
    assert "#SBATCH --job-name=export" in export
    assert "4.70 GB of the target (embedding, head and final norm by name)" in export


def test_plan_refuses_a_stage_whose_engine_does_not_fit_its_gpus(make_cfg):
    """Kimi-K2.5 over 4 GPUs: 148.6 GB of weights per GPU, more than an H200 holds."""
    cfg = make_cfg("experiment=kimi-k2.5", "serve.tp_size=4")
    plans = stage_plans(cfg, ["data", "extract", "train", "export", "bench"])
    with pytest.raises(Eagle3Error) as refused:
        check_plans(cfg, plans)
    assert str(refused.value) == (
        "data does not fit its GPUs: weights 148.6 + KV cache 0.3 + activations 21.2 = 170.0 GB "
        "per GPU > pipeline.plan.gpu_memory_gb=141 (submitit_slurm job, 1 node(s) (any) x 4 "
        "GPU(s), 1 task(s) per node)"
    )
    assert plans["extract"].gpu_gb() <= 141 and plans["train"].gpu_gb() <= 141


def test_smollm2_dry_run_refuses_offline_training_beyond_one_process(test_root):
    """Engine regeneration, engine capture and offline training: no stage loads SmolLM2 whole, yet
    offline training holds its embedding (tied head) and norm, 0.11 GB, more than 0.01 GB."""
    proc = run_pipeline(
        test_root,
        "pipeline.dry_run=true",
        "pipeline.process_memory_gb=0.01",
        "extract.backend=vllm",
        "data.regen.backend=engine",
        "train.hidden_states=offline",
    )
    assert proc.returncode == 1 and "plan valid" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "eagle3 error: train does not fit one host process: it holds 0.11 GB of the target "
        "(embedding, head and final norm by name) > pipeline.process_memory_gb=0.01  "
        "(add debug=true for the traceback)"
    )


def test_dry_run_refuses_a_2_tb_target_in_one_process_naming_the_setting(test_root):
    proc = run_pipeline(
        test_root, "experiment=kimi-k2.5", "pipeline.dry_run=true", "extract.backend=hf"
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        "extract.backend=hf captures hidden states with the HF target in one process" in proc.stderr
    )
    assert "594 GB of weights" in proc.stderr and "pipeline.process_memory_gb=120" in proc.stderr


def test_dry_run_rejects_an_impossible_spec_naming_the_rule(test_root):
    proc = run_pipeline(
        test_root,
        "experiment=kimi-k2.5",
        "pipeline.dry_run=true",
        "pipeline.bench_sweep=['spec.depth=16','spec.steps=3']",
    )
    assert proc.returncode == 1
    assert "a chain drafts depth-1 = 15 steps" in proc.stderr and "Traceback" not in proc.stderr


def test_every_experiment_composes_and_its_bench_jobs_resolve(make_cfg):
    """Each experiments/*.yaml composes, and every job of its bench sweep (as Hydra will split it) gives a
    spec that passes the spec rules."""

    from eagle3.core.spec import resolve_spec
    from eagle3.pipeline.app import bench_jobs

    names = sorted(path.stem for path in (REPO / "experiments").glob("*.yaml"))
    assert {"quickstart", "smollm2-h200", "smollm2-h200-turns3", "smollm2-h200-turns3-v32k"} <= set(
        names
    )
    for name in names:
        jobs = bench_jobs(make_cfg(f"experiment={name}"))
        assert jobs, name
        for job in jobs:
            resolve_spec(make_cfg(f"experiment={name}", *job).spec)
    v32k = make_cfg("experiment=smollm2-h200-turns3-v32k")
    assert v32k.drafter.draft_vocab_size == 32768 and v32k.data.regen.max_new_tokens == 192
    assert (
        len(bench_jobs(make_cfg("experiment=smollm2-h200"))) == 9
    )  # 3 suites x d32s3k8, d32s4k8, d64s5k8

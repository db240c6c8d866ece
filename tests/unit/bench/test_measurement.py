"""What a bench job's engine meets first: the warm-up (eagle3.bench.measurement) and a server sized
for the job's batch (eagle3.bench.engines.job_setup)."""

import dataclasses

import pytest

from eagle3.bench.engines import job_setup
from eagle3.bench.measurement import warmup_count
from eagle3.core.common import Eagle3Error
from eagle3.core.spec import OFF, resolve_spec
from eagle3.data.suites import check_bench_settings
from eagle3.serve.launch import compose_launch, engine_setup


@pytest.mark.parametrize(
    ("warmup", "batch_size", "prompts", "expected"),
    [
        (None, 1, 32, 1),  # the default: one full batch
        (None, 16, 32, 16),
        (None, 16, 8, 8),  # never more than the suite holds
        (1, 16, 32, 1),  # a typed value wins
        (0, 16, 32, 0),
    ],
)
def test_the_warmup_is_one_full_batch_unless_set(make_cfg, warmup, batch_size, prompts, expected):
    bench = dataclasses.replace(make_cfg().bench, warmup=warmup, batch_size=batch_size)
    check_bench_settings(bench)
    assert warmup_count(bench, prompts) == expected


def test_a_negative_warmup_is_refused(make_cfg):
    assert make_cfg().bench.warmup is None
    with pytest.raises(Eagle3Error, match=r"bench.warmup=-1: must be an integer >= 0"):
        check_bench_settings(make_cfg("bench.warmup=-1").bench)


@pytest.mark.parametrize(
    ("serve", "batch_size", "flag", "expected"),
    [
        ("sglang", 16, "--cuda-graph-max-bs-decode", "16"),  # decode graphs cover the batch
        ("sglang", 4, "--cuda-graph-max-bs-decode", "8"),  # never lowered
        ("vllm", 16, "--max-num-seqs", "16"),  # the scheduler keeps the whole batch
        ("vllm", 1, "--max-num-seqs", "8"),
    ],
)
def test_a_jobs_server_is_sized_for_its_batch(make_cfg, serve, batch_size, flag, expected):
    """bench.batch_size requests in flight run on CUDA graphs / in one scheduler step: the job's
    server command (eagle3.bench.engines.job_setup) raises serve's setting to the batch size."""
    cfg = make_cfg(f"serve={serve}", f"bench.batch_size={batch_size}")
    setup = job_setup(engine_setup(cfg), resolve_spec(cfg.spec))
    argv = compose_launch(setup, OFF, None, "/m", 30000).argv
    assert argv[argv.index(flag) + 1] == expected
    assert engine_setup(cfg).serve == cfg.serve  # the config itself is unchanged

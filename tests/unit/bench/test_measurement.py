"""How many requests warm an engine up before the measured passes (eagle3.bench.measurement)."""

import dataclasses

import pytest

from eagle3.bench.measurement import warmup_count
from eagle3.core.common import Eagle3Error
from eagle3.data.suites import check_bench_settings


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

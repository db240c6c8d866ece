"""Typed configs: every option composes into its schema; bad keys and types fail at composition."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from eagle3.core import config as schema
from eagle3.core.common import CONF_DIR, compose

# options that need a value their yaml leaves to the user (???)
REQUIRED = {"data=file": ["data.source=x.jsonl"], "target=hf": ["target.path=x"]}


def options() -> list[str]:
    conf = Path(CONF_DIR)
    return [
        f"{group.name}={yaml.stem}"
        for group in sorted(conf.iterdir())
        if group.is_dir() and group.name != "hydra"
        for yaml in sorted(group.glob("*.yaml"))
    ]


def untyped(overrides: list[str]):
    """The composed config as Hydra's DictConfig (compose() returns it typed)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def test_every_option_composes_into_its_schema_with_the_values_of_its_yaml():
    kinds = {"target": schema.TARGET_KINDS, "serve": schema.SERVE_ENGINES}
    assert len(options()) >= 50
    for option in options():
        overrides = [option, *REQUIRED.get(option, []), "paths.root=/r"]
        raw = untyped(overrides)
        cfg = schema.typed(raw)
        assert isinstance(cfg, schema.Config)
        assert type(cfg.target) is kinds["target"][cfg.target.kind], option
        assert type(cfg.serve) is kinds["serve"][cfg.serve.engine], option
        # the typed sections hold exactly what the yaml composed (the stage hashes read them)
        for name in ("target", "data", "drafter", "extract", "train", "export", "spec", "bench"):
            expected = OmegaConf.to_container(raw[name], resolve=True)
            assert schema.plain(getattr(cfg, name)) == expected, (option, name)


def test_a_typed_config_reads_back_from_its_plain_data():
    for option in ("target=tiny-llama", "target=tiny-moe", "serve=sglang", "serve=vllm-bundle"):
        cfg = compose([option, "paths.root=/r"])
        again = schema.from_plain(schema.plain(cfg))
        assert again == cfg
        assert type(again.target) is type(cfg.target) and type(again.serve) is type(cfg.serve)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1e-4", "Key 'lrr' not in 'TrainConfig'"),
        ("train.lr=fast", "Value 'fast' of type 'str' could not be converted to Float"),
        ("bench.repeats=two", "Value 'two' of type 'str' could not be converted to Integer"),
        ("target.gguf_file=x.gguf", "Key 'gguf_file' not in 'RandomTargetConfig'"),
        ("serve.tp_size=2", "Key 'tp_size' not in 'LocalServeConfig'"),
        ("engine.overlap_steps=maybe", "Value 'maybe' is not a valid bool"),
    ],
)
def test_a_misspelt_key_or_a_wrong_type_fails_at_composition(override, message):
    with pytest.raises(ConfigCompositionException) as failed:
        compose(["target=tiny-llama", override])
    assert message in str(failed.value.__cause__)


def test_a_kind_takes_its_own_keys():
    assert compose(["serve=sglang", "serve.tp_size=2"]).serve.tp_size == 2
    assert compose(["target=smollm2-135m", "target.gguf_file=y.gguf"]).target.gguf_file == "y.gguf"


def test_a_value_left_to_the_user_is_named_at_the_entry():
    with pytest.raises(MissingMandatoryValue, match="target.path"):
        compose(["target=hf"])


def test_copies_replace_one_field_and_leave_the_original():
    cfg = compose(["target=tiny-llama"])
    sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, limit=7))
    assert (sized.train.limit, cfg.train.limit) == (7, None)
    assert sized.target is cfg.target


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.val_fraction=1.5", "data.val_fraction=1.5 is out of range: it must be in [0, 1)"),
        ("data.limit=-5", "data.limit=-5 is out of range: it must be >= 1 or null"),
        ("train.epochs=0", "train.epochs=0 is out of range: it must be >= 1"),
        ("train.lr=-1", "train.lr=-1.0 is out of range: it must be >= 0"),
        ("train.ttt_length=0", "train.ttt_length=0 is out of range: it must be >= 1"),
        ("train.warmup_ratio=1.5", "train.warmup_ratio=1.5 is out of range: it must be in [0, 1]"),
        ("data.regen.top_p=0", "data.regen.top_p=0.0 is out of range: it must be in (0, 1]"),
    ],
)
def test_a_value_out_of_its_range_fails_at_composition_naming_key_value_and_range(
    override, message
):
    with pytest.raises(schema.OutOfRange) as refused:
        compose([override])
    assert str(refused.value) == message


def test_values_at_the_ends_of_their_ranges_compose():
    cfg = compose(["data.val_fraction=0", "data.limit=1", "train.lr=0", "train.ttt_length=1"])
    assert (cfg.data.val_fraction, cfg.data.limit, cfg.train.lr, cfg.train.ttt_length) == (
        0,
        1,
        0,
        1,
    )
    assert compose(["data.limit=null"]).data.limit is None


def test_the_dry_run_refuses_a_value_out_of_range_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "eagle3.pipeline", "pipeline.dry_run=true", "train.epochs=0"],
        capture_output=True,
        text=True,
        env={**os.environ, "EAGLE3_ROOT": str(tmp_path)},
        timeout=300,
    )
    assert proc.returncode == 1 and "plan valid" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "eagle3 error: train.epochs=0 is out of range: it must be >= 1  "
        "(add debug=true for the traceback)"
    ]

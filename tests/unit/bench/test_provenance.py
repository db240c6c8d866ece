"""The engine version a bench row records, read in the environment the engine starts with."""

import dataclasses
import sys

from eagle3.bench.provenance import engine_version


def test_the_engine_version_is_read_with_the_engines_own_path(make_cfg, tmp_path):
    """A bundle's engine lives on a folder its serve.env puts on PYTHONPATH (serve=sglang-bundle):
    the version is read from there, not from the bench's own environment."""
    site = tmp_path / "site-sglang"
    dist_info = site / "sglang-0.5.14.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.14\n")
    serve = dataclasses.replace(make_cfg("serve=sglang").serve, python=sys.executable, env={})
    assert engine_version(serve) == "sglang unknown"
    with_site = dataclasses.replace(serve, env={"PYTHONPATH": str(site)})
    assert engine_version(with_site) == "sglang 0.5.14"

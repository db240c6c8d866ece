"""Engine ports: SGLang 0.5.14 also opens port + 10000 (its gRPC port, refused above 65535), so the
port eagle3 chooses for it leaves every derived port valid and free, and a port the user gives that
cannot is refused before launch."""

from __future__ import annotations

import socket

import pytest

from eagle3.core.common import Eagle3Error
from eagle3.core.spec import resolve_spec
from eagle3.serve.launch import compose_launch, engine_setup, free_port


def test_a_free_port_for_sglang_keeps_its_grpc_port_valid_and_free(make_cfg):
    offsets = list(make_cfg("serve=sglang").serve.derived_port_offsets)
    assert offsets == [10000]
    for _ in range(300):  # the kernel hands out ports up to 60999: about one in five is too high
        port = free_port("127.0.0.1", offsets)
        assert port + 10000 <= 65535
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port + 10000))  # free: this bind would raise otherwise


def test_a_given_port_whose_grpc_port_is_out_of_range_is_refused(make_cfg):
    cfg = make_cfg("serve=sglang", "serve.port=60000", "serve.validate_args=false", "spec=off")
    with pytest.raises(
        Eagle3Error,
        match=r"serve.port=60000: sglang also opens port 70000 \(port \+ 10000, "
        r"serve.derived_port_offsets\), above 65535: choose a port at most 55535",
    ):
        compose_launch(engine_setup(cfg), resolve_spec(cfg.spec), None, "/nonexistent/target")

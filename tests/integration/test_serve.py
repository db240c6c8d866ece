"""Engines (eagle3.serve.launch, eagle3.serve.counters): command composition (vLLM, SGLang through SGLang's own
parser), process lifecycle with real processes, vLLM counter parsing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from support import REPO, SGLANG_PYTHON, http_server_launch

from eagle3.core.common import Eagle3Error
from eagle3.core.spec import OFF, resolve_spec
from eagle3.serve.counters import acceptance_from_counters, counter_delta, parse_vllm_metrics
from eagle3.serve.launch import (
    EngineFailed,
    EngineProcess,
    Launch,
    check_spec_for_engine,
    compose_launch,
    engine_setup,
    free_port,
    sglang_argv,
    sglang_cuda_graph_flag,
    sglang_parse_many,
)

TARGET = "/models/target"
DRAFTER = "/models/drafter"


# ---------------------------------------------------------------- vLLM


def test_vllm_refuses_trees_before_launch(make_cfg):
    cfg = make_cfg("serve=vllm", "spec=d10s5")
    with pytest.raises(Eagle3Error, match="vLLM drafts chains only"):
        compose_launch(engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET)
    check_spec_for_engine("sglang", resolve_spec(cfg.spec))  # trees are fine elsewhere
    check_spec_for_engine("local", resolve_spec(cfg.spec))


def test_vllm_command(make_cfg):
    cfg = make_cfg("serve=vllm", "spec=d16")
    launch = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=4321
    )
    argv = launch.argv
    assert argv[:3] == [str(REPO / ".venv-vllm/bin/vllm"), "serve", TARGET]  # vLLM's own CLI
    assert "--model" not in argv and argv[argv.index("--port") + 1] == "4321"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": DRAFTER,
        "num_speculative_tokens": 15,
    }
    assert launch.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    off = compose_launch(engine_setup(cfg), OFF, None, TARGET, port=4321)
    assert "--speculative-config" not in off.argv


def test_spec_needs_a_drafter(make_cfg):
    cfg = make_cfg("serve=vllm")
    with pytest.raises(Eagle3Error, match="needs a drafter"):
        compose_launch(engine_setup(cfg), resolve_spec(cfg.spec), None, TARGET)


VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 10.0
vllm:generation_tokens_total{engine="0",model_name="m"} 55.0
"""


def test_parse_vllm_metrics_and_acceptance():
    after = parse_vllm_metrics(VLLM_METRICS)
    assert after == {
        "num_drafts": 20.0,
        "num_draft_tokens": 60.0,
        "num_accepted_tokens": 30.0,
        "accepted_per_pos": [15.0, 10.0, 5.0],
    }
    before = {
        "num_drafts": 10.0,
        "num_draft_tokens": 30.0,
        "num_accepted_tokens": 10.0,
        "accepted_per_pos": [8.0],
    }
    delta = counter_delta(before, after)
    assert delta == {
        "num_drafts": 10.0,
        "num_draft_tokens": 30.0,
        "num_accepted_tokens": 20.0,
        "accepted_per_pos": [7.0, 10.0, 5.0],
    }
    acc = acceptance_from_counters(delta)
    assert acc["accept_length"] == 3.0 and acc["accept_per_pos"] == [0.7, 1.0, 0.5]
    assert acc["draft_acceptance_rate"] == pytest.approx(20 / 30)
    assert (
        acceptance_from_counters(counter_delta(after, after)) == {}
    )  # no drafts: no acceptance claimed


# ---------------------------------------------------------------- SGLang


def test_sglang_cuda_graph_flag_by_version():
    assert sglang_cuda_graph_flag("0.5.19") == "--cuda-graph-max-bs"
    assert sglang_cuda_graph_flag("0.5.20") == "--cuda-graph-max-bs-decode"
    assert sglang_cuda_graph_flag("0.5.23.post1") == "--cuda-graph-max-bs-decode"


def test_sglang_argv_accepted_by_sglangs_own_parser(make_cfg):
    """Our composed commands go through sglang.srt.server_args.prepare_server_args (the installed
    SGLang 0.5.23 in .venv-sglang, built by `make sglang`) and come back with our spec."""
    assert SGLANG_PYTHON.exists(), "run `make sglang` (tools/setup_sglang.sh) to build .venv-sglang"
    cfg = make_cfg("serve=sglang", f"serve.python={SGLANG_PYTHON}")
    specs = [
        resolve_spec(make_cfg(f"spec={preset}").spec)
        for preset in spec_presets()
        if preset != "off"
    ]
    stale = make_cfg("serve=sglang", f"serve.python={SGLANG_PYTHON}", "serve.version=0.5.19")
    trust = cfg.target.trust_remote_code
    argvs = [sglang_argv(cfg.serve, trust, spec, DRAFTER, TARGET, 30000) for spec in specs]
    argvs += [
        sglang_argv(cfg.serve, trust, OFF, None, TARGET, 30000),
        sglang_argv(stale.serve, trust, OFF, None, TARGET, 30000),
    ]
    *spec_results, off, refused = sglang_parse_many(str(SGLANG_PYTHON), argvs)
    for spec, result in zip(specs, spec_results):
        parsed = result["parsed"]
        assert (
            parsed["speculative_algorithm"],
            parsed["speculative_num_steps"],
            parsed["speculative_eagle_topk"],
            parsed["speculative_num_draft_tokens"],
        ) == ("EAGLE3", spec.steps, spec.topk, spec.depth)
        assert parsed["speculative_draft_model_path"] == DRAFTER and parsed["model_path"] == TARGET
        # SGLang forces draft tokens = steps + 1 for chains: our chains already satisfy it
        assert (
            spec.topk > 1
            or parsed["speculative_num_draft_tokens"] == parsed["speculative_num_steps"] + 1
        )
    assert off["parsed"]["speculative_algorithm"] is None and off["parsed"]["tp_size"] == 1
    # the parser really validates: the pre-0.5.20 flag is refused by 0.5.23
    assert "cuda-graph-max-bs" in refused["error"]


def spec_presets() -> list[str]:
    return sorted(path.stem for path in (REPO / "conf" / "spec").glob("*.yaml"))


def test_spec_presets_say_their_sglang_flags(make_cfg):
    """Every conf/spec preset's comment names the SGLang flags of the spec it resolves to."""
    assert {"off", "default", "d4", "d6s3k2", "d8s4k2", "d12s5k3", "d16", "d10s5"} <= set(
        spec_presets()
    )
    for preset in spec_presets():
        spec = resolve_spec(make_cfg(f"spec={preset}").spec)
        lines = (REPO / "conf" / "spec" / f"{preset}.yaml").read_text().splitlines()
        comment = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
        flags = (
            f"--speculative-num-draft-tokens {spec.depth} --speculative-num-steps {spec.steps} "
            f"--speculative-eagle-topk {spec.topk}"
        )
        assert (flags in comment) == spec.enabled, preset


def test_spec_rules_match_sglangs(make_cfg):
    """SGLang: steps/topk/draft tokens all or none; topk=1 forces draft tokens = steps + 1."""
    with pytest.raises(Eagle3Error, match="chain drafts depth-1"):
        resolve_spec(make_cfg("spec.depth=8", "spec.steps=3").spec)
    with pytest.raises(Eagle3Error, match="needs spec.steps"):
        resolve_spec(make_cfg("spec.depth=8", "spec.topk=2").spec)
    assert resolve_spec(make_cfg("spec=d16").spec).steps == 15


# ---------------------------------------------------------------- local


# SGLang 0.5.14 registers a config its own way under a name transformers 5.17 already ships
SGLANG_STYLE_REGISTRATION = """
import multiprocessing, sys
from transformers import AutoConfig, PretrainedConfig

class Qwen3ASRConfig(PretrainedConfig):  # the engine's own class for the name
    model_type = "qwen3_asr"

def register():
    AutoConfig.register("qwen3_asr", Qwen3ASRConfig)
    return type(AutoConfig.for_model("qwen3_asr")).__qualname__

def in_child(queue):
    queue.put(register())

if __name__ == "__main__":
    print(register())
    context = multiprocessing.get_context("spawn")  # SGLang starts its scheduler this way
    queue = context.Queue()
    child = context.Process(target=in_child, args=(queue,))
    child.start()
    print(queue.get(timeout=120))
    child.join()
    class Llama(PretrainedConfig):
        model_type = "llama"
    AutoConfig.register("llama", Llama)  # a name not configured: refused as before
"""


def test_sglang_launch_tolerates_the_config_names_transformers_already_has(make_cfg, tmp_path):
    """The SGLang launch's environment (serve.tolerate_config_names=[qwen3_asr]) lets the engine and
    the processes it spawns register qwen3_asr with transformers' real AutoConfig.register, which
    otherwise raises; a name not configured still raises."""
    script = tmp_path / "engine.py"
    script.write_text(SGLANG_STYLE_REGISTRATION)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert "ValueError: 'qwen3_asr' is already used by a Transformers config" in plain.stderr
    cfg = make_cfg("serve=sglang-bundle", "spec=d8")
    launch = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=4321
    )
    assert launch.env["EAGLE3_TOLERATED_CONFIG_NAMES"] == "qwen3_asr"
    assert launch.env["PYTHONPATH"].split(os.pathsep)[0] == str(
        REPO / "src" / "eagle3" / "serve" / "config_clash"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, **launch.env},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.stdout.splitlines() == ["Qwen3ASRConfig", "Qwen3ASRConfig"]
    assert "ValueError: 'llama' is already used by a Transformers config" in done.stderr


def test_the_config_clash_shim_still_runs_the_sitecustomize_it_shadows(make_cfg, tmp_path):
    """A machine's own sitecustomize later on PYTHONPATH still runs in an SGLang launch."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.MACHINE_SITE = 'ran'\n")
    cfg = make_cfg("serve=sglang-bundle", "spec=d8")
    env = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=4321
    ).env
    env = {**os.environ, **env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(own)}
    check = "import builtins, sitecustomize; print(builtins.MACHINE_SITE, sitecustomize.NAMES)"
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "ran frozenset({'qwen3_asr'})", done.stderr


def test_bundle_presets_launch_the_machines_python(make_cfg):
    """serve=sglang-bundle / vllm-bundle: the engine runs in the machine's own Python (found on
    PATH), SGLang with triton attention and no grammar backend, vLLM as a module without the
    flashinfer sampler."""
    import shutil

    python3 = shutil.which("python3")
    cfg = make_cfg("serve=sglang-bundle", "spec=d8")
    argv = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=4321
    ).argv
    assert argv[:3] == [python3, "-m", "sglang.launch_server"]
    assert argv[-4:] == ["--attention-backend", "triton", "--grammar-backend", "none"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--cuda-graph-max-bs" in argv
    cfg = make_cfg("serve=vllm-bundle", "spec.depth=4")
    launch = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=4321
    )
    assert launch.argv[:5] == [python3, "-m", "vllm.entrypoints.cli.main", "serve", TARGET]
    assert launch.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and "--enforce-eager" not in launch.argv


def test_local_launch_passes_the_exact_config(make_cfg, tmp_path):
    """The local server gets the job's resolved config (spec, port, drafter) as its primary config;
    an eagle3 Hydra app composes it back unchanged."""
    cfg = make_cfg("target=tiny-llama", "spec=d10s5")
    launch = compose_launch(
        engine_setup(cfg), resolve_spec(cfg.spec), Path(DRAFTER), TARGET, port=5555
    )
    (tmp_path / "engine_config.yaml").write_text(launch.files["engine_config.yaml"])
    job = yaml.safe_load(launch.files["engine_config.yaml"])
    assert job["spec"] == {"enabled": True, "depth": 10, "steps": 5, "topk": 4}
    assert job["serve"]["port"] == 5555 and job["drafter"]["path"] == DRAFTER
    argv = [a.replace("{folder}", str(tmp_path)) for a in launch.argv]
    assert argv[1:3] == ["-m", "eagle3.serve.server"]
    out = subprocess.run(
        [sys.executable, "-m", "eagle3.tools.info", *argv[3:], "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == job


# ---------------------------------------------------------------- process lifecycle (real processes)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_engine_start_healthy_stop_kills_the_whole_group(tmp_path):
    port = free_port("127.0.0.1")
    child_pid_file = tmp_path / "child.pid"
    launch = http_server_launch(port, prefix=f"sleep 300 & echo $! > {child_pid_file}; ")
    with EngineProcess(launch, tmp_path, "engine") as engine:
        engine.wait_healthy(60)
        assert httpx.get(engine.base_url + "/").status_code == 200
        child = int(child_pid_file.read_text())
        assert pid_alive(child) and engine.alive()
    assert not engine.alive() and not pid_alive(child)  # the server and its background child
    assert (
        "GET / HTTP" in (tmp_path / "engine.log").read_text()
    )  # output captured to the job folder
    assert json.loads((tmp_path / "command.json").read_text())["argv"][0] == "bash"


def test_engine_that_exits_fails_with_its_log(tmp_path):
    launch = Launch(
        "vllm",
        [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
        {},
        "127.0.0.1",
        free_port("127.0.0.1"),
    )
    engine = EngineProcess(launch, tmp_path).start()
    with pytest.raises(EngineFailed, match="exited with code 3") as err:
        engine.wait_healthy(60)
    assert "boom: bad flag" in err.value.log_tail


def test_engine_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    with pytest.raises(EngineFailed, match="not found: run `make vllm`"):
        EngineProcess(Launch("vllm", ["/nonexistent/python"], {}, "127.0.0.1", 1), tmp_path).start()
    launch = Launch("vllm", ["sleep", "300"], {}, "127.0.0.1", free_port("127.0.0.1"))
    engine = EngineProcess(launch, tmp_path).start()
    start = time.monotonic()
    with pytest.raises(EngineFailed, match="not healthy after 2s"):
        engine.wait_healthy(2)
    assert time.monotonic() - start < 10
    engine.stop(5)
    assert not engine.alive()


def test_killed_server_is_detected(tmp_path):
    engine = EngineProcess(http_server_launch(free_port("127.0.0.1")), tmp_path).start()
    try:
        engine.wait_healthy(60)
        engine.check_alive()
        os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait(10)
        with pytest.raises(EngineFailed, match="died"):
            engine.check_alive()
    finally:
        engine.stop(5)


def test_serve_app_refuses_a_tree_for_vllm_in_one_line(test_root, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.serve",
            "serve=vllm",
            "spec=d10s5",
            f"paths.root={test_root}",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("eagle3 error: spec d10s5k4 (topk=4) is a tree")
    )
    assert not (tmp_path / "engine.log").exists()  # nothing was launched


def answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_on_a_port_another_server_holds_names_the_engines_own_error(test_root, tmp_path):
    """Another HTTP server holds serve.port and answers /health with 200: serve does not announce
    it as its engine (the health check wants this launch's token) and the engine's own last log
    lines ("Address already in use") reach the user in the one-line error."""
    port = free_port("127.0.0.1")
    served = tmp_path / "other"
    served.mkdir()
    (served / "health").write_text("ok")
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    other = subprocess.Popen(argv, cwd=served, stderr=subprocess.DEVNULL)
    try:
        wait = time.monotonic() + 30
        while not answers(f"http://127.0.0.1:{port}/health"):
            assert time.monotonic() < wait
            time.sleep(0.1)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "eagle3.serve",
                "target=tiny-llama",
                "spec=off",
                "engine.cpu_threads=1",
                f"serve.port={port}",
                f"paths.root={test_root}",
                f"hydra.run.dir={tmp_path}/run",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert other.poll() is None  # the other server was left alone
    finally:
        other.kill()
        other.wait()
    assert out.returncode == 1 and "serving" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("eagle3 error: local server exited with code 1 before becoming healthy")
    assert "address already in use" in last.lower()


def test_an_engine_without_a_launch_token_is_refused_a_port_in_use(tmp_path):
    """vLLM and SGLang cannot echo a launch token: a port something already listens on (a real
    HTTP server answering 200) is refused before anything starts."""
    port = free_port("127.0.0.1")
    holder = EngineProcess(http_server_launch(port), tmp_path / "holder").start()
    try:
        holder.wait_healthy(60)
        launch = Launch("vllm", ["sleep", "300"], {}, "127.0.0.1", port)
        with pytest.raises(EngineFailed, match=f"127.0.0.1:{port} is already in use"):
            EngineProcess(launch, tmp_path / "vllm").start()
        assert not (tmp_path / "vllm" / "engine.log").exists()  # nothing was started
    finally:
        holder.stop(5)

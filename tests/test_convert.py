"""`python -m megarl.convert`: an imported HF model loads bit-exact at TP=2; the checkpoint trained
from it exports to a directory whose transformers logits equal the engine's; bad paths fail clearly."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from megarl.convert import main
from megarl.engine.checkpoint_dir import write_checkpoint_file
from tests.dist_utils import PRELOAD, run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch

REPO = Path(__file__).resolve().parents[1]


def _convert_process(_, argvs: list[list[str]], log: str) -> None:
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    for argv in argvs:
        rc = main(argv)
        sys.stderr.flush()
        assert rc == 0, f"{argv}: exit {rc}\n{Path(log).read_text()[-3000:]}"


def convert(*argvs, log: Path) -> str:
    """`main(argv)` for each argv, in turn, in one process forked from the session's forkserver (torch and megatron
    imported once there, as run_distributed's ranks are): each call starts and ends a process group, which pytest's
    own process must not hold. Its stderr (written to `log`)."""
    mp.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: the session's first call
    context = mp.start_processes(_convert_process, nprocs=1, join=False, start_method="forkserver",
                                 args=([[str(a) for a in argv] for argv in argvs], str(log)))
    deadline = time.monotonic() + 300
    while not context.join(timeout=1.0):  # raises ProcessRaisedException, with the traceback, where main fails
        if time.monotonic() > deadline:
            context.processes[0].kill()
            raise TimeoutError(f"convert {argvs} did not finish within 300 s")
    return log.read_text()


def round_trip(hf: Path, root: Path) -> tuple[list, list]:
    """The hf-to-megatron and megatron-to-hf argv that take `hf` to root/imported and back to root/back."""
    return ["hf-to-megatron", hf, root / "imported"], ["megatron-to-hf", root / "imported", root / "back"]


def bf16_dir(config, path: Path, seed: int = 4) -> Path:
    """A tiny random model of `config` (None: make_qwen2_dir's Qwen2) saved in bf16 at `path` (built in float32 next
    to it)."""
    from transformers import AutoModelForCausalLM

    from tests.models.hf_families import save_random

    fp32 = path.with_name(path.name + "_fp32")
    source = make_qwen2_dir(fp32, tied=False) if config is None else save_random(config, fp32, seed=seed)
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(path)
    return path


def glm4_moe_with_mtp_dir(path: Path) -> Path:
    """A bf16 GLM-4.5 with the multi-token-prediction layer its published checkpoints hold (model.layers.2.*, not
    built by megarl; written in float32: stored in bf16 as the rest, the routing bias in float32)."""
    from tests.models.hf_families import glm4_moe_config
    from tests.test_convert_hf_checkpoint import add_mtp_layer

    hf = bf16_dir(glm4_moe_config(), path)
    mtp = add_mtp_layer(hf)
    tensors = load_file(hf / "model.safetensors")
    save_file({n: t if n not in mtp or n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
               for n, t in tensors.items()}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.fixture(scope="module")
def bf16_round_trips(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each bf16 model (a Qwen2 and four families) through hf-to-megatron and megatron-to-hf, all in one forked
    process: name -> (the HF directory, the one written back)."""
    from tests.models.hf_families import gemma3_config, mixtral_config, qwen3_next_config

    root = tmp_path_factory.mktemp("bf16_round_trips")
    dirs = {"qwen2": bf16_dir(None, root / "qwen2" / "hf")}
    for name, config in (("mixtral", mixtral_config()), ("qwen3_next", qwen3_next_config()),
                         ("gemma3", gemma3_config())):
        dirs[name] = bf16_dir(config, root / name / "hf")
    dirs["glm4_moe"] = glm4_moe_with_mtp_dir(root / "glm4_moe" / "hf")
    convert(*(argv for hf in dirs.values() for argv in round_trip(hf, hf.parent)), log=root / "convert.log")
    return {name: (hf, hf.parent / "back") for name, hf in dirs.items()}


def read_round_trip(round_trips, name) -> tuple[dict, dict]:
    """The original tensors and those written back (every shard)."""
    hf, back = round_trips[name]
    return load_file(hf / "model.safetensors"), {n: t for path in back.glob("*.safetensors")
                                                 for n, t in load_file(path).items()}


def _train_rank(rank, imported, root):
    """Start from the imported checkpoint at TP=2, train, save: the imported weights (as HF tensors) and
    the trained model's log-probs."""
    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
    from megarl.engine import MegatronEngine
    from tests.engine.test_checkpoint import save

    actor = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2))
    engine = MegatronEngine(str(Path(imported) / "actor" / "hf"), actor, AlgorithmConfig(), "cpu", 1, 10,
                            load_hf_weights=False)
    engine.load_checkpoint(str(Path(imported) / "actor"))
    imported_weights = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    for _ in range(3):
        engine.train(padded_batch(rows=8, seed=7), loss="sft")
    save(engine, Path(root), 3)
    return imported_weights, engine.compute_logprobs(padded_batch(rows=8, seed=9))["logprobs"]


def test_import_train_export_matches_transformers(tmp_path):
    hf = make_qwen2_dir(tmp_path / "hf", tied=False)
    # `python -m megarl.convert` itself, once; the other tests call its main() in a forked process
    done = subprocess.run([sys.executable, "-m", "megarl.convert", "hf-to-megatron", hf, tmp_path / "imported"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported, engine_logprobs = run_distributed(_train_rank, 2, str(tmp_path / "imported"), str(tmp_path / "ckpt"),
                                                tp=2)
    original = load_file(f"{hf}/model.safetensors")
    assert original.keys() == imported.keys()
    assert all(torch.equal(original[n], imported[n]) for n in original)  # the import is exact
    # the checkpoint root: its newest complete checkpoint is exported, in shards of at most ~20 KB
    convert(["megatron-to-hf", tmp_path / "ckpt", tmp_path / "trained", "--max-shard-gb", 2e-5],
            log=tmp_path / "convert.log")
    trained = tmp_path / "trained"
    index = json.loads((trained / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(original)
    assert json.loads((trained / "config.json").read_text())["dtype"] == "float32"
    batch = padded_batch(rows=8, seed=9)
    hf_trained, _ = hf_logprobs_entropy(str(trained), batch)
    hf_original, _ = hf_logprobs_entropy(hf, batch)
    torch.testing.assert_close(hf_trained, engine_logprobs, rtol=0, atol=1e-5)
    assert (hf_trained - hf_original).abs().max() > 1e-2  # the export holds the trained weights


def test_bad_paths_fail_with_a_message(tmp_path, capsys):
    def error(*argv) -> str:
        assert main([str(a) for a in argv]) == 2
        return capsys.readouterr().err

    hf = make_qwen2_dir(tmp_path / "hf", tied=True)
    assert "does not exist" in error("hf-to-megatron", tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in error("hf-to-megatron", tmp_path / "empty", tmp_path / "out")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((Path(hf) / "config.json").read_text())
    assert "no *.safetensors" in error("hf-to-megatron", tmp_path / "config_only", tmp_path / "out")
    assert "not an empty directory" in error("hf-to-megatron", hf, tmp_path / "config_only")

    assert "does not exist" in error("megatron-to-hf", tmp_path / "nowhere", tmp_path / "out")
    assert "neither a checkpoint" in error("megatron-to-hf", hf, tmp_path / "out")
    critic_only = tmp_path / "critic_only"
    critic_only.mkdir()
    write_checkpoint_file(critic_only, 5, ["critic"], None)
    assert "has no role 'actor' (it holds: critic)" in error("megatron-to-hf", critic_only, tmp_path / "out")
    with pytest.raises(SystemExit):  # argparse: an unknown command
        main(["hf-to-hf", hf, str(tmp_path / "out")])


def test_a_missing_output_parent_is_named_before_torch_is_imported(tmp_path):
    """The CLI checks its paths first: the answer comes at once, not after loading torch and megatron."""
    probe = ("import sys; from megarl.convert import main; rc = main(sys.argv[1:]); "
             "print(rc, 'torch' in sys.modules, 'megatron.core' in sys.modules)")
    for argv in (["hf-to-megatron", tmp_path, tmp_path / "missing" / "out"],
                 ["megatron-to-hf", tmp_path, tmp_path / "missing" / "out"]):
        done = subprocess.run([sys.executable, "-c", probe, *map(str, argv)], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.split() == ["2", "False", "False"], done.stderr
        assert f"the parent directory of the output, {tmp_path / 'missing'}, does not exist" in done.stderr


def test_a_bf16_model_comes_back_bf16_and_bit_exact(bf16_round_trips):
    """Imported on the CPU a bf16 model is held in float32; its export is bf16 again (the model's own dtype, where
    --dtype is not given), equal to the original bit for bit."""
    original, back = read_round_trip(bf16_round_trips, "qwen2")
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert json.loads((bf16_round_trips["qwen2"][1] / "config.json").read_text())["dtype"] == "bfloat16"


def test_mixtral_comes_back_bit_exact_under_its_checkpoint_names(bf16_round_trips):
    """A bf16 Mixtral through hf-to-megatron and megatron-to-hf: every tensor (the router and the experts'
    w1/w3/w2 under block_sparse_moe) bit for bit, and a config.json transformers loads as Mixtral again."""
    from transformers import AutoConfig

    original, back = read_round_trip(bf16_round_trips, "mixtral")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in back
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(bf16_round_trips["mixtral"][1]).num_local_experts == 4


def test_glm4_moe_comes_back_bit_exact_with_its_mtp_layer(bf16_round_trips):
    """A bf16 GLM-4.5 with the multi-token-prediction layer its published checkpoints hold (model.layers.2.* here,
    not built by megarl) through hf-to-megatron and megatron-to-hf: every tensor bit for bit, the routing bias still
    float32, the MTP layer written back as read, and a config.json transformers loads as GLM-4.5 again."""
    from transformers import AutoConfig

    original, back = read_round_trip(bf16_round_trips, "glm4_moe")
    mtp = {n for n in original if n.startswith("model.layers.2.")}
    assert "model.layers.2.eh_proj.weight" in mtp and mtp < set(back)
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert back["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert AutoConfig.from_pretrained(bf16_round_trips["glm4_moe"][1]).model_type == "glm4_moe"


def test_qwen3_next_comes_back_bit_exact(bf16_round_trips):
    """A bf16 Qwen3-Next (grouped in_proj_qkvz / in_proj_ba, routed experts, the shared expert and its gate) through
    hf-to-megatron and megatron-to-hf: every tensor bit for bit, and a config.json transformers loads again."""
    from transformers import AutoConfig

    original, back = read_round_trip(bf16_round_trips, "qwen3_next")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in back
    assert "model.layers.1.mlp.shared_expert_gate.weight" in back
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(bf16_round_trips["qwen3_next"][1]).model_type == "qwen3_next"


def test_gemma3_comes_back_bit_exact(bf16_round_trips):
    """A bf16 Gemma 3 (tied embedding, four norms per layer, QK-norm) through hf-to-megatron and megatron-to-hf: every
    tensor bit for bit, and a config.json transformers loads as Gemma 3 again (its per-layer-type RoPE kept)."""
    from transformers import AutoConfig

    from tests.models.hf_families import gemma3_config

    original, back = read_round_trip(bf16_round_trips, "gemma3")
    assert "model.layers.3.post_feedforward_layernorm.weight" in back and "lm_head.weight" not in back
    assert original.keys() == back.keys() and all(torch.equal(original[n], back[n]) for n in original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    config = AutoConfig.from_pretrained(bf16_round_trips["gemma3"][1])
    assert config.model_type == "gemma3_text" and config.rope_parameters == gemma3_config().rope_parameters

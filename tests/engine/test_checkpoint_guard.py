"""A checkpoint knows its run and is checked before a resume (megarl/resume.py, megarl/engine/manifest.py,
megarl/config/fingerprint.py): settings compared key by key, each kind of damage named and the previous complete
checkpoint used, and a run whose checkpoint already completed trainer.steps ends at once. Checkpoints here are
written through Checkpoints.stage/commit with files shaped like an engine's (a dist checkpoint's shard and
.metadata), no engine."""

import json
import os
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.tiny import tiny_config
from megarl.config.fingerprint import ESTIMATOR_KNOBS, LOSS_KNOBS, NOT_TRAINING, differences, fingerprint, unread_keys
from megarl.config.moved_keys import MOVED_KEYS
from megarl.engine.checkpoint_dir import CheckpointError, Checkpoints, checkpoint_damage
from megarl.engine.manifest import BLOCK_BYTES, SMALL_FILE_BYTES
from megarl.resume import plan_resume

from tests.conftest import QUICKSTART

SHARD = "actor/state/__0_0.distcp"
SHARD_BYTES = 3 * SMALL_FILE_BYTES  # past the small-file size: checked by sampled blocks


def config(tmp_path, *overrides):
    return tiny_config([f"trainer.output_dir={tmp_path}", *overrides], path=QUICKSTART)


def save(cfg, step: int, beside: tuple[str, ...] = (), settings: bool | dict = True) -> Path:
    """A checkpoint of `step` committed as the trainer commits one, with `cfg`'s settings (False: none, an older
    megarl's; a dict: those stored settings); `beside`: driver files next to checkpoint.json (e.g. the async modes'
    async_buffer.pt)."""
    checkpoints = Checkpoints(Path(cfg.trainer.output_dir) / "checkpoints", 0, cfg.trainer.verify_checkpoint)
    staging = checkpoints.stage(step)
    state = staging / "actor" / "state"
    state.mkdir(parents=True)
    (state / "__0_0.distcp").write_bytes(os.urandom(SHARD_BYTES))
    (state / ".metadata").write_bytes(os.urandom(2000))
    (staging / "actor" / "engine.json").write_text(json.dumps({"format": 1, "step_count": step}))
    for name in beside:
        (staging / name).write_bytes(os.urandom(500))
    stored = fingerprint(cfg) if settings is True else settings or None
    return checkpoints.commit(staging, step, {"step": step}, stored)


def truncate(path: Path) -> str:
    """Cut to half its size; the manifest's words for that."""
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:size // 2])
    return f"{size // 2} bytes, the manifest says {size} (truncated)"


def zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


DAMAGE = {  # each damages a checkpoint and returns the line that must name it
    "truncated shard": lambda c: f"{SHARD}: " + truncate(c / SHARD),
    "zero-filled shard": lambda c: zero_fill(c / SHARD) or (
        f"{SHARD}: contents differ from the manifest at bytes 0-{BLOCK_BYTES}: zero-filled"),
    "deleted shard": lambda c: (c / SHARD).unlink() or f"{SHARD}: missing",
    "deleted .metadata": lambda c: (c / "actor/state/.metadata").unlink() or "actor/state/.metadata: missing",
    "truncated checkpoint.json": lambda c: "checkpoint.json: " + truncate(c / "checkpoint.json"),
    "truncated manifest": lambda c: truncate(c / "manifest.json") and "manifest.json: unreadable (JSONDecodeError: ",
    "deleted manifest": lambda c: (c / "manifest.json").unlink() or "manifest.json: missing",
    "missing async buffer": lambda c: (c / "async_buffer.pt").unlink() or "async_buffer.pt: missing",
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, capsys, kind):
    cfg = config(tmp_path, "trainer.mode=async")
    save(cfg, 1, beside=("async_buffer.pt",))
    newest = save(cfg, 2, beside=("async_buffer.pt",))
    named = DAMAGE[kind](newest)
    start = plan_resume(cfg)
    assert start.checkpoint == tmp_path / "checkpoints" / "step_00000001" and start.step == 1
    out = capsys.readouterr().out
    assert f"damaged checkpoint(s) skipped:\n  {newest}: {named}" in out
    assert f"resuming from the previous complete one, {start.checkpoint}" in out


def test_truncated_checkpoint_json_is_named_once_by_its_size(tmp_path):
    cfg = config(tmp_path)
    newest = save(cfg, 1)
    named = "checkpoint.json: " + truncate(newest / "checkpoint.json")
    assert checkpoint_damage(newest, "sampled") == [named]
    (newest / "manifest.json").unlink()  # no manifest to say it: its JSON does
    [problem] = checkpoint_damage(newest, "sampled")
    assert problem.startswith("checkpoint.json: not valid JSON (") and problem.endswith("truncated or overwritten?")


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path):
    cfg = config(tmp_path)
    for step in (1, 2):
        (save(cfg, step) / SHARD).unlink()
    with pytest.raises(CheckpointError) as error:
        plan_resume(cfg)
    message = str(error.value)
    assert message.startswith("no intact checkpoint to resume (trainer.resume=auto):")
    for step in (2, 1):
        assert f"{tmp_path}/checkpoints/step_0000000{step}: {SHARD}: missing" in message
    assert "Move the damaged checkpoints out of the way" in message and "trainer.output_dir" in message
    # a checkpoint named by path is checked too
    with pytest.raises(CheckpointError, match=f"step_00000001: {SHARD}: missing"):
        plan_resume(config(tmp_path, f"trainer.resume={tmp_path}/checkpoints/step_00000001"))


def test_verify_checkpoint_modes_check_what_they_say(tmp_path):
    """sizes: sizes only; sampled: the blocks (a change between them passes); full: every byte."""
    cfg = config(tmp_path, "trainer.verify_checkpoint=full")
    checkpoint = save(cfg, 1)
    shard = checkpoint / SHARD
    data = bytearray(shard.read_bytes())
    between = BLOCK_BYTES + 10  # past the first sampled block, before the second
    data[between] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_damage(checkpoint, "sizes") == []
    assert checkpoint_damage(checkpoint, "sampled") == []
    assert checkpoint_damage(checkpoint, "full") == [f"{SHARD}: contents differ from the manifest"]
    zero_fill(shard)
    assert checkpoint_damage(checkpoint, "sizes") == []
    assert checkpoint_damage(checkpoint, "full") == [f"{SHARD}: contents differ from the manifest: zero-filled"]
    named = f"{SHARD}: " + truncate(shard)
    assert checkpoint_damage(checkpoint, "sizes") == [named]
    # a manifest written in sizes mode holds no checksums: even full checks sizes only
    sized = save(config(tmp_path / "sizes", "trainer.verify_checkpoint=sizes"), 1)
    zero_fill(sized / SHARD)
    assert checkpoint_damage(sized, "full") == []


def test_other_settings_are_refused_under_auto_naming_each_key(tmp_path, capsys):
    save(config(tmp_path), 120)
    with pytest.raises(ConfigError) as error:
        plan_resume(config(tmp_path, "actor.optim.lr=0", "algorithm.kl_coef=0.02"))
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/checkpoints/step_00000120 was written by a run with other settings:")
    assert "\n  actor.optim.lr: 0.0005 -> 0.0\n  algorithm.kl_coef: 0.01 -> 0.02\n" in message
    assert "a new trainer.output_dir" in message and "trainer.resume=force" in message
    # force: resumed with the changes, which are named
    start = plan_resume(config(tmp_path, "actor.optim.lr=0", "trainer.resume=force"))
    assert start.step == 120 and start.checkpoint.name == "step_00000120"
    out = capsys.readouterr().out
    assert "warning: resuming" in out and "(trainer.resume=force):\n  actor.optim.lr: 0.0005 -> 0.0" in out
    # a checkpoint chosen by path: named, not refused
    chosen = tmp_path / "checkpoints" / "step_00000120"
    assert plan_resume(config(tmp_path, "actor.optim.lr=0", f"trainer.resume={chosen}")).checkpoint == chosen
    assert "actor.optim.lr: 0.0005 -> 0.0" in capsys.readouterr().out


def test_keys_that_do_not_change_training_resume_freely(tmp_path, capsys):
    save(config(tmp_path), 3)
    start = plan_resume(config(tmp_path, "trainer.steps=200", "trainer.eval_every=1", "trainer.loggers=jsonl",
                               "trainer.save_every=7", "trainer.keep_last=0", "actor.parallel.tp=1",
                               "actor.micro_batch_size=4", "trainer.worker_timeout_s=60",
                               "trainer.verify_checkpoint=sizes", "trainer.experiment_name=x"))
    assert start.step == 3 and capsys.readouterr().out == ""
    assert "trainer.output_dir" in NOT_TRAINING and "trainer.resume" in NOT_TRAINING
    assert all(reason for reason in NOT_TRAINING.values())


def test_a_key_the_saved_run_did_not_have_counts_as_its_default(tmp_path):
    current = fingerprint(config(tmp_path))
    older = {"sha256": "other", "values": {k: v for k, v in current["values"].items() if k != "algorithm.tis_cap"}}
    assert differences(older, current) == []
    changed = fingerprint(config(tmp_path, "algorithm.tis_cap=3.0"))
    assert differences(older, changed) == ["algorithm.tis_cap: 2.0 -> 3.0"]


def test_settings_the_run_does_not_read_do_not_refuse_its_checkpoint(tmp_path, capsys):
    """A GRPO run reads no critic, no GAE lambda or discount, no reward model and no other loss's knobs: their values
    (megarl's defaults changed: algorithm.lam 0.95 -> 1.0, critic.optim.weight_decay 0 -> 0.01) pass; a read one is
    refused by name."""
    save(config(tmp_path, "algorithm.lam=0.95", "critic.optim.weight_decay=0.0"), 5)
    unread = ["algorithm.lam=1.0", "algorithm.gamma=0.9", "critic.optim.weight_decay=0.01", "critic.value_clip=0.2",
              "reward_model.optim.lr=0.1", "reward_model.weight=2.0", "algorithm.gspo.clip_eps=0.01",
              "algorithm.dual_clip.clip_ratio_c=5.0", "algorithm.sapo.tau_neg=2.0", "algorithm.otb.zero_tail=false",
              "algorithm.loss_agg_norm_len=512", "async.max_staleness=3", "preference.pairs_per_step=4"]
    assert plan_resume(config(tmp_path, *unread)).step == 5 and capsys.readouterr().out == ""
    for key, old, new in (("algorithm.norm_adv_by_std", "true", "false"), ("algorithm.clip_eps", "0.2", "0.3"),
                          ("algorithm.advantage", '"grpo"', '"rloo"')):
        with pytest.raises(ConfigError, match=f"\n  {key}: {old} -> {new}\n"):
            plan_resume(config(tmp_path, *unread, f"{key}={new.strip(chr(34))}"))


def test_a_setting_either_run_reads_is_compared(tmp_path):
    """A critic run's lam and critic are read; a switch of estimator names the knobs the saved run read too."""
    gae = ("algorithm.advantage=gae", "algorithm.lam=0.9", "critic.optim.weight_decay=0.01")  # tiny: 0.95, 0.0
    save(config(tmp_path / "gae", *gae), 5)
    with pytest.raises(ConfigError) as error:
        plan_resume(config(tmp_path / "gae", *gae[:1]))
    assert "\n  algorithm.lam: 0.9 -> 0.95\n  critic.optim.weight_decay: 0.01 -> 0.0\n" in str(error.value)
    assert differences(fingerprint(config(tmp_path, *gae)), fingerprint(config(tmp_path))) == [
        'algorithm.advantage: "gae" -> "grpo"', "algorithm.lam: 0.9 -> 0.95", "critic.optim.weight_decay: 0.01 -> 0.0"]
    with_rm = fingerprint(config(tmp_path, "reward_model.path=/models/rm", "reward_model.weight=2.0"))
    assert differences(with_rm, fingerprint(config(tmp_path, "reward_model.path=/models/rm"))) == \
        ["reward_model.weight: 2.0 -> 1.0"]


def test_every_estimator_and_loss_has_its_knobs_listed_and_a_plugin_reads_all():
    from megarl.algorithms.advantages import ADVANTAGES  # (the package registers every built-in loss)
    from megarl.algorithms.losses import POLICY_LOSSES

    assert sorted(ESTIMATOR_KNOBS) == ADVANTAGES.names() and sorted(LOSS_KNOBS) == POLICY_LOSSES.names()
    values = fingerprint(tiny_config())["values"]
    knobs = {f"algorithm.{k}" for table in (ESTIMATOR_KNOBS, LOSS_KNOBS) for ks in table.values() for k in ks}
    assert all(any(v == k or v.startswith(k + ".") for v in values) for k in knobs)  # options or sections of them
    plugin = unread_keys(values | {"algorithm.advantage": "my_pkg.adv:fn", "algorithm.policy_loss": "my_pkg.loss:fn"})
    assert not plugin & knobs and "critic" in plugin  # a plugin estimator may read any knob; only gae has a critic


def test_settings_stored_under_former_key_names_are_compared_under_the_new_ones(tmp_path):
    """A checkpoint whose settings name keys that have moved since (algorithm.gspo_clip_eps, now
    algorithm.gspo.clip_eps; algorithm.pf_ppo, now algorithm.pf_ppo.method) resumes under the same values, and a
    changed one is named by its new key."""
    run = ("algorithm.policy_loss=gspo", "algorithm.gspo.clip_eps=0.001", "algorithm.pf_ppo.method=pow")
    former = {new: old for old, new in MOVED_KEYS.items()}
    current = fingerprint(config(tmp_path, *run))
    stored = {"sha256": "an older megarl's", "values": {former.get(k, k): v for k, v in current["values"].items()}}
    assert stored["values"]["algorithm.gspo_clip_eps"] == 0.001 and stored["values"]["algorithm.pf_ppo"] == "pow"
    save(config(tmp_path, *run), 5, settings=stored)
    assert plan_resume(config(tmp_path, *run)).step == 5
    with pytest.raises(ConfigError, match="\n  algorithm.gspo.clip_eps: 0.001 -> 0.002\n"):
        plan_resume(config(tmp_path, *run, "algorithm.gspo.clip_eps=0.002"))


def test_a_checkpoint_from_before_settings_and_manifests_resumes_with_warnings(tmp_path, capsys):
    cfg = config(tmp_path)
    checkpoint = save(cfg, 4, settings=False)
    (checkpoint / "manifest.json").unlink()
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    del meta["manifest"]  # as an older megarl wrote it
    (checkpoint / "checkpoint.json").write_text(json.dumps(meta))
    assert plan_resume(config(tmp_path, "actor.optim.lr=0")).step == 4
    out = capsys.readouterr().out
    assert f"warning: {checkpoint} was written without a manifest (by an older megarl): its files are not checked" in out
    assert f"warning: {checkpoint} was written before checkpoints kept their run's settings" in out


def test_the_manifest_is_committed_with_the_checkpoint(tmp_path):
    checkpoint = save(config(tmp_path), 1)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["mode"] == "sampled"
    assert set(manifest["files"]) == {"checkpoint.json", SHARD, "actor/state/.metadata", "actor/engine.json"}
    assert len(manifest["files"][SHARD]["blocks"]) == 8 and "sha256" not in manifest["files"][SHARD]
    assert "sha256" in manifest["files"]["actor/state/.metadata"]
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    assert meta["manifest"] == "manifest.json" and meta["config"] == fingerprint(config(tmp_path))


def test_main_ends_at_once_when_the_checkpoint_completed_trainer_steps(tmp_path, capsys, monkeypatch):
    """python -m megarl.train: past trainer.steps exits 0, other settings exit 2, both before Ray starts."""
    import megarl.train

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(megarl.train, "start_ray", no_ray)
    args = ["--config", str(QUICKSTART), f"trainer.output_dir={tmp_path}"]
    save(load_config(QUICKSTART, args[2:]), 120)  # the recipe's config as main reads it: the same fingerprint
    assert megarl.train.main(args + ["trainer.steps=5"]) == 0
    assert (f"{tmp_path}/checkpoints/step_00000120 completed step 120, and trainer.steps=5: nothing to train"
            in capsys.readouterr().out)
    assert megarl.train.main(args + ["trainer.steps=120"]) == 0
    assert megarl.train.main(args + ["actor.optim.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "config error: " in err and "actor.optim.lr: 0.0005 -> 0.0" in err and "trainer.resume=force" in err
    assert (tmp_path / "run.lock").read_text() == ""  # released


def test_the_agent_loops_settings_are_compared_only_where_a_run_has_it(tmp_path):
    """A run without the agent loop resumes whatever its settings were (agent.parser's default was hermes, now
    auto); one with it compares them. agent.observation_template renders SFT warm-start traces either way."""
    assert differences(fingerprint(config(tmp_path, "agent.parser=hermes", "agent.max_turns=2")),
                       fingerprint(config(tmp_path))) == []
    assert differences(fingerprint(config(tmp_path, "agent.observation_template=<r>{result}</r>")),
                       fingerprint(config(tmp_path))) == ['agent.observation_template: "<r>{result}</r>" -> ""']
    on = "agent.enabled=true"
    assert differences(fingerprint(config(tmp_path, on, "agent.parser=hermes")), fingerprint(config(tmp_path, on))) \
        == ['agent.parser: "hermes" -> "auto"']

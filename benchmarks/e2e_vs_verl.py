"""End-to-end GRPO speed: megarl against verl 0.9.1, one after the other on the same GPU.

    python -m benchmarks.e2e_vs_verl --out-dir OUT --verl-site /tmp/site-verl    # one GPU, one model size
    python -m benchmarks.e2e_vs_verl --smoke --out-dir OUT                       # CPU: megarl side + plumbing

The same setup for both, as benchmarks/e2e_vs_trl.py builds it (its helpers are used here): a random Qwen2 of
--model's shape with the offline BPE of exactly its vocabulary, prompts of exactly --prompt-len tokens,
completions forced to --completion-len tokens (ignore_eos on both), --n-samples per prompt, --completions per
step, the vowel_share rule reward, no KL term and no reference model, bf16, one optimizer update per step,
micro-batches of at most --micro-batch x (prompt + completion) tokens (verl: use_dynamic_bsz with that
ppo_max_token_len_per_gpu; megarl: actor.max_tokens_per_micro_batch), SGLang with the triton attention and
pytorch sampling backends at the same --sglang-mem-fraction on both sides (the bundle strips FA3; verl's own
default for sglang >= 0.5.12 is flashinfer). The tokenizer gets a chat template that renders a user message as
its bare text, so verl's chat-formatted prompts are the same tokens as megarl's plain ones, and Qwen's chat tokens
inside its vocabulary, which verl asks of a qwen2 model (model_dir_problems lists all it asks; verl_prompt_check
runs verl's own code on the directory in verl's stack before verl starts).

verl runs `python -m verl.trainer.main_ppo` (its v1 synchronous trainer: FSDP actor, SGLang colocated in the
hybrid engine, the one-GPU mode; no parameter or optimizer offload; its fused LM head and log-probs, without which
its log-probs loop over every token when flash-attn is absent) with the hydra overrides verl_overrides() writes,
from its own site directory (--verl-site: sglang 0.5.12, transformers 5.9.0; scripts/gpu/build_verl_chunk.sh),
in a process that never imports megarl's stack. flash-attn is not installable offline, so
verl runs padded (use_remove_padding=False) and the JSON says so. megarl runs `python -m megarl.train` (Megatron
+ SGLang 0.5.17 colocated). Before each system, `sglang.Engine` of that system's SGLang version generates the
same batch (--probe, in a slice of the budget of its own), so a difference between SGLang versions is not taken
for one between the systems. Each process has a cap; a system stopped at it is summarised over the steps it
logged (status 'partial', with the steps planned and completed), and the JSON and the table are written whatever
happens, also when the script itself is stopped. Warm-up and measured steps can differ per side (--verl-steps).

Reported per side, over the measured steps (warm-up steps left out): per-phase seconds from the system's own
timers (verl's timing_s/*, megarl's timing/*), tokens/s/GPU as NeMo-RL counts them (every prompt and completion
token of the step over the step's wall time and the GPUs held: one), the rollout's generated tokens/s beside
its SGLang's bare Engine, and the MFU of the update phase (benchmarks/engine_throughput.py's model_flops over
the real tokens). OUT gets e2e_vs_verl.json, verl's resolved config (verl_config.yaml), both logs and metrics;
UNMATCHED below lists what is not the same on both sides, and why. A short table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from benchmarks.common import (ROOT, add_run_arguments, add_workload_arguments, check_completions, environment,
                               run_process, smoke_sizes, start_run)
from benchmarks.e2e_vs_trl import (_gpu_memory_used, _parameter_counts, build_model, megarl_command, megarl_steps,
                                   model_shape, summarize, write_prompts)
from benchmarks.verl_model_dir import PLAIN_CHAT_TEMPLATE, QWEN_CHAT_TOKENS, model_dir_problems, verl_prompt_check
from megarl.utils.tracking import run_metrics

VERL_PHASES = {  # verl's top-level timing_s/<name> of a v1 synchronous step -> phase; the rest of step is 'other'
    "gen": "generation", "reward": "reward", "old_log_prob": "log-probs", "ref": "reference", "adv": "advantages",
    "update_actor": "update", "update_weights": "weight sync"}
STOP_GRACE_S = 60  # past a process's cap: run_process's SIGINT-to-SIGKILL wait (30 s) + wait_gpu_free's (30 s)
UNMATCHED = {
    "old log-probs": "megarl's algorithm.recompute_old_logprobs=auto skips the extra forward when the step makes one "
                     "update (the training forward's detached log-probs are the old ones, exactly); verl's "
                     "trainer always runs it (timing_s/old_log_prob). --megarl-old-logprobs always matches verl",
    "padding": "verl without flash-attn runs padded rows (use_remove_padding=False); megarl packs sequences into "
               "micro-batches of at most the same token budget. With completions forced to full length every "
               "row has the same length, so this costs verl little here",
    "SGLang version": "verl 0.9.1 pins sglang 0.5.12 (+ sglang-kernel 0.4.2.post2, transformers 5.9.0); megarl's "
                      "bundle runs 0.5.17: each side's rollout is reported against its own version's bare Engine",
    "transformers": "sglang 0.5.12 itself pins transformers 5.6.0; verl[sglang] pins 5.9.0, which is what verl runs",
    "training engine": "verl: FSDP (--verl-strategy) over HF transformers modules with fp32 master weights and "
                       "bf16 compute; megarl: Megatron-core GPTModel, bf16 with an fp32 optimizer copy",
    "gradient checkpointing": "verl's default is on; off here (--verl-grad-ckpt) as megarl's actor.recompute=none",
    "weight decay": "verl's AdamW default 0.01, megarl's 0.0: no effect on speed; left at each default",
    "log-prob head": "verl: its fused head (model.use_fused_kernels, --verl-fused-kernels, default backend torch: "
                     "logits of 512 tokens at a time in fp32, recomputed in the backward); megarl: Megatron's LM "
                     "head, then log-probs over the micro-batch's logits. verl's unfused path without flash-attn "
                     "loops in Python over every token (see verl_overrides)",
    "entropy": "verl's old-log-prob pass always computes the entropy (its actor/entropy metric); in verl's fused "
               "head it comes with the log-probs",
    "torch.compile": "verl's use_torch_compile (default true) compiles only its entropy on the remove-padding path: "
                     "unused here (padded, fused head)",
}


def verl_reward(data_source, solution_str, ground_truth, extra_info=None, **_):
    """verl's compute_score signature over the shared vowel_share reward."""
    from benchmarks.e2e_vs_trl import vowel_share

    return vowel_share(solution_str, ground_truth, {})


def write_verl_rows(src: Path, dst: Path) -> None:
    """megarl's {"prompt", "answer"} rows -> verl's RLHFDataset rows (jsonl, which verl reads like parquet)."""
    with dst.open("w") as f:
        for i, line in enumerate(src.read_text().splitlines()):
            row = json.loads(line)
            f.write(json.dumps({"data_source": "e2e_vs_verl", "prompt": [{"role": "user", "content": row["prompt"]}],
                                "reward_model": {"style": "rule", "ground_truth": row["answer"]},
                                "extra_info": {"index": i}}) + "\n")


def verl_overrides(args, model_dir: Path, train: Path, val: Path, run_dir: Path, reward_file: Path) -> list[str]:
    """The hydra overrides of verl's ppo_trainer config for this run (keys of verl 0.9.1's
    verl/trainer/config/ppo_trainer.yaml)."""
    prompts = args.completions // args.n_samples
    tokens_per_micro = args.micro_batch * (args.prompt_len + args.completion_len)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    sglang = f"+{r}.engine_kwargs.sglang"
    return [
        f"hydra.run.dir={run_dir}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.completion_len}",
        "data.filter_overlong_prompts=false", "data.truncation=error", "data.shuffle=false",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=false",
        # verl's FSDP model asks transformers for flash_attention_2 unless told otherwise: no flash-attn here
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.verl_grad_ckpt).lower()}",
        # verl's fused LM head + log-probs (not its default): without flash-attn, verl's unfused log-probs are
        # logprobs_from_logits_v2 (verl/utils/torch_functional.py:95-106), a Python loop over the first dimension
        # (:197, :202), and the padded path hands it (tokens, vocab) logits (workers/engine/fsdp/
        # transformer_impl.py:1503, :1522): ~10k iterations of small kernels per micro-batch, forward and backward,
        # 0.65 s a 16 x 640-token forward at 0.5B in the first run. With flash-attn, verl would use its triton
        # cross entropy instead; the fused head is verl's own way to the same numbers without it
        *verl_fused_head(args.verl_fused_kernels),
        f"{a}.strategy={args.verl_strategy}", f"{a}.optim.lr=1e-6", f"{a}.ppo_mini_batch_size={prompts}",
        f"{a}.ppo_epochs=1", f"{a}.use_dynamic_bsz=true", f"{a}.ppo_max_token_len_per_gpu={tokens_per_micro}",
        f"{a}.use_kl_loss=false", f"{a}.entropy_coeff=0", f"{a}.loss_agg_mode=token-mean", f"{a}.clip_ratio=0.2",
        f"{a}.fsdp_config.param_offload=false", f"{a}.fsdp_config.optimizer_offload=false",
        f"{r}.name=sglang", f"{r}.mode=async", f"{r}.tensor_model_parallel_size=1", f"{r}.n={args.n_samples}",
        f"{r}.temperature=1.0", f"{r}.top_p=1.0", f"{r}.top_k=-1", f"{r}.ignore_eos=true",
        f"{r}.gpu_memory_utilization={args.sglang_mem_fraction}", f"{r}.max_num_seqs={max(256, args.completions)}",
        f"{r}.enforce_eager=false", f"{r}.free_cache_engine=true",
        f"{sglang}.attention_backend=triton", f"{sglang}.sampling_backend=pytorch",
        f"{sglang}.cuda_graph_max_bs={min(1024, max(256, args.completions))}",  # decode graphs for every row
        # verl 0.9.1 hands rollout.ignore_eos to vLLM only (vllm_async_server.py): SGLang gets it as its server's
        # default sampling parameter, under the request's own (which never set ignore_eos)
        f"{sglang}.preferred_sampling_params='{json.dumps({'ignore_eos': True})}'",
        f"reward.custom_reward_function.path={reward_file}", "reward.custom_reward_function.name=verl_reward",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console,file]",
        f"trainer.total_training_steps={args.verl_warmup + args.verl_steps}", "trainer.total_epochs=1000",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "trainer.use_v1=true", "trainer.v1.trainer_mode=sync",
        "trainer.project_name=e2e_vs_verl", "trainer.experiment_name=grpo", f"trainer.default_local_dir={run_dir}/ckpt",
        # the file logger runs in verl's TaskRunner actor: its path goes there through Ray's runtime_env
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run_dir / 'metrics.jsonl'}",
    ]


def verl_fused_head(backend: str) -> list[str]:
    """The overrides of verl's fused LM head (verl/models/transformers/dense_common.py): 'torch' (the default backend
    of verl's model config: chunked PyTorch), 'triton' (verl's triton kernel), or 'off' (verl's default: unfused)."""
    if backend == "off":
        return ["actor_rollout_ref.model.use_fused_kernels=false"]
    return ["actor_rollout_ref.model.use_fused_kernels=true",
            f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}"]


def verl_steps(metrics_file: Path) -> list[dict]:
    """The steps of verl's file logger (one {"step", "data"} row per step) as summarize() rows."""
    steps = []
    if not metrics_file.exists():
        return steps
    for line in metrics_file.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the line being written when verl was stopped
            continue
        row = entry.get("data", {})
        if "timing_s/step" not in row:
            continue
        phases = {VERL_PHASES[k[9:]]: v for k, v in row.items() if k.startswith("timing_s/") and k[9:] in VERL_PHASES}
        phases["other"] = max(0.0, row["timing_s/step"] - sum(phases.values()))
        steps.append({"step": entry.get("step"), "seconds": row["timing_s/step"],
                      "response_length": row["response_length/mean"], "phases": phases,
                      "raw_timing": {k: v for k, v in row.items() if k.startswith("timing_s/")}})
    return steps


def update_mfu(shape: dict, completions: int, sequence_len: int, update_s: float, peak_flops: float) -> float:
    """MFU of an update phase over the real tokens (every sequence at full length: completions are forced)."""
    from benchmarks.engine_throughput import model_flops

    return model_flops(shape, [sequence_len] * completions) / update_s / peak_flops


def rollout_numbers(record: dict, probe: dict, completions: int) -> dict:
    """The rollout's generated tokens/s (completions x mean response / generation phase) against its SGLang's bare
    Engine on the same batch."""
    gen = record.get("phase_s", {}).get("generation")
    if not gen or not record.get("response_length"):
        return {}
    rollout = completions * record["response_length"] / gen
    out = {"rollout_tokens_per_s": round(rollout, 1)}
    if probe.get("generated_tokens_per_s"):
        out |= {"engine_tokens_per_s": probe["generated_tokens_per_s"],
                "rollout_vs_engine": round(rollout / probe["generated_tokens_per_s"], 3)}
    return out


# ---- the bare sglang.Engine probe: runs in the stack under test (its own PYTHONPATH) ---------------------


def engine_probe(args) -> int:
    """Generate the step's batch with `sglang.Engine` of whichever SGLang this process imports: one warm-up round,
    then --probe-rounds timed ones asking for each token's log-prob, as both systems' rollouts do (megarl's always,
    verl's with rollout.calculate_log_probs, on in its resolved config), then as many without (what the log-probs
    cost SGLang). Writes {"generated_tokens_per_s", "round_s", "plain_tokens_per_s", "versions"} to --probe-out."""
    import sglang
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()]
    ids = [tokenizer(t)["input_ids"] for t in texts[:args.completions // args.n_samples] for _ in range(args.n_samples)]
    from sglang.srt.server_args import ServerArgs

    # decode CUDA graphs up to the batch's rows, as megarl captures them (0.5.17 renamed the argument)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    graph_rows = "cuda_graph_max_bs_decode" if "cuda_graph_max_bs_decode" in fields else "cuda_graph_max_bs"
    engine = sglang.Engine(model_path=args.model_dir, attention_backend="triton", sampling_backend="pytorch",
                           mem_fraction_static=args.sglang_mem_fraction, skip_tokenizer_init=True, dtype="bfloat16",
                           log_level="error", **{graph_rows: min(1024, max(256, args.completions))})
    params = {"max_new_tokens": args.completion_len, "ignore_eos": True, "temperature": 1.0}
    rounds, plain = [], []
    try:
        for i in range(1 + 2 * args.probe_rounds):
            logprobs = i <= args.probe_rounds
            t = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=logprobs)
            seconds = time.perf_counter() - t
            if i:
                (rounds if logprobs else plain).append((seconds, sum(len(o["output_ids"]) for o in out)))
    finally:
        engine.shutdown()
    versions = {}
    for name in ("sglang", "sglang-kernel", "transformers", "torch", "verl", "flashinfer-python"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    Path(args.probe_out).write_text(json.dumps({
        "round_s": [round(s, 3) for s, _ in rounds], "generated_tokens": [n for _, n in rounds],
        "generated_tokens_per_s": round(sum(n for _, n in rounds) / sum(s for s, _ in rounds), 1),
        "return_logprob": True, "plain_round_s": [round(s, 3) for s, _ in plain],
        "plain_tokens_per_s": round(sum(n for _, n in plain) / sum(s for s, _ in plain), 1),
        "versions": versions}))
    return 0


# ---- driver ----------------------------------------------------------------------------------------------


def run_probe(args, name: str, env: dict, model_dir: Path, prompts: Path, out: Path, cap: float) -> dict:
    result = out / f"probe_{name}.json"
    cmd = [sys.executable, "-m", "benchmarks.e2e_vs_verl", "--probe-only", "--out-dir", str(out),
           "--model-dir", str(model_dir), "--prompts", str(prompts), "--probe-out", str(result),
           "--completions", str(args.completions), "--n-samples", str(args.n_samples),
           "--completion-len", str(args.completion_len), "--sglang-mem-fraction", str(args.sglang_mem_fraction),
           "--probe-rounds", str(args.probe_rounds)]
    record = run_process(cmd, out / f"probe_{name}.log", cap, env, leftovers=str(model_dir))
    return record | (json.loads(result.read_text()) if result.exists() else {})


def run_verl(args, env: dict, model_dir: Path, work: Path, out: Path, cap: float) -> tuple[dict, list]:
    run_dir = work / "verl_run"
    train, val = work / "verl_train.jsonl", work / "verl_val.jsonl"
    write_verl_rows(work / "prompts.jsonl", train)
    write_verl_rows(work / "val.jsonl", val)
    reward_file = work / "verl_reward.py"  # verl loads it by path: a shim onto this module's function
    reward_file.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                           "from benchmarks.e2e_vs_verl import verl_reward  # noqa: E402,F401\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = verl_overrides(args, model_dir, train, val, run_dir, reward_file)
    (out / "verl_overrides.txt").write_text("\n".join(overrides) + "\n")
    metrics = run_dir / "metrics.jsonl"
    if args.smoke:
        return {"status": "skipped (verl needs a GPU: its FSDP workers and SGLang server run on CUDA only); "
                          "its overrides are in verl_overrides.txt"}, []
    # seconds, in verl's stack, before verl's minutes of start-up: its prompt builder on this model directory
    started = time.monotonic()
    check = run_process([sys.executable, "-m", "benchmarks.e2e_vs_verl", "--verl-check", "--out-dir", str(out),
                         "--model-dir", str(model_dir), "--prompts", str(work / "prompts.jsonl")],
                        out / "verl_check.log", min(cap, 120), env)
    if check["status"] != "ok":
        return check | {"failed_in": "verl_prompt_check (verl's prompt builder refused the model directory)"}, []
    record = run_process([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], out / "verl.log",
                         cap - (time.monotonic() - started), env, leftovers=str(model_dir))
    if metrics.exists():
        (out / "verl_metrics.jsonl").write_text(metrics.read_text())
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if hydra_cfg.exists():  # the config verl ran with, interpolations resolved (in verl's stack: its omegaconf)
        resolve = ("import sys; from omegaconf import OmegaConf; "
                   "print(OmegaConf.to_yaml(OmegaConf.load(sys.argv[1]), resolve=True))")
        try:
            done = subprocess.run([sys.executable, "-c", resolve, str(hydra_cfg)], env=env, capture_output=True,
                                  text=True, timeout=60)
            resolved, error = (done.stdout, "") if done.returncode == 0 else ("", done.stderr[-300:])
        except subprocess.TimeoutExpired:
            resolved, error = "", "timed out"
        (out / "verl_config.yaml").write_text(resolved or f"# not resolved: {error}\n" + hydra_cfg.read_text())
    return record, side_steps("verl", work)


def verl_check(args) -> int:
    """--verl-check: verl_prompt_check on the first prompt, in verl's stack; its ids must be megarl's."""
    from transformers import AutoTokenizer

    prompt = json.loads(Path(args.prompts).read_text().splitlines()[0])["prompt"]
    ids = verl_prompt_check(Path(args.model_dir), prompt)
    plain = AutoTokenizer.from_pretrained(args.model_dir)(prompt, add_special_tokens=False)["input_ids"]
    print(f"verl's prompt: {len(ids)} tokens, megarl's: {len(plain)}, the same: {ids == plain}")
    return 0 if ids == plain else 1


def run_megarl(args, env: dict, model_dir: Path, work: Path, out: Path, cap: float, device: str) -> tuple[dict, list]:
    run_dir = work / "megarl_run"
    seq = args.prompt_len + args.completion_len
    cmd = megarl_command(args, model_dir, work / "prompts.jsonl", work / "val.jsonl", args.completions, run_dir, device)
    cmd += [f"actor.max_tokens_per_micro_batch={args.micro_batch * seq}",
            f"algorithm.recompute_old_logprobs={args.megarl_old_logprobs}"]
    record = run_process(cmd, out / "megarl.log", cap, env, leftovers=str(model_dir))
    if run_metrics(run_dir).exists():
        (out / "megarl_metrics.jsonl").write_text(run_metrics(run_dir).read_text())
    return record, side_steps("megarl", work)


def side_steps(side: str, work: Path) -> list[dict]:
    """The steps a side's run has logged so far (its metrics file, as summarize() rows)."""
    if side == "verl":
        return verl_steps(work / "verl_run" / "metrics.jsonl")  # verl's file logger, at the path the command names
    return megarl_steps(run_metrics(work / "megarl_run"))


def side_record(args, side: str, shape: dict, record: dict, steps: list[dict], probe: dict) -> dict:
    """A side's process record and per-step rows -> its numbers over the measured steps (its warm-up left out):
    tokens/s/GPU (one GPU a side), the update's MFU, the rollout against its Engine, verl's raw timers. A side
    stopped at its cap is summarised over the steps it completed: status 'partial' when that leaves a measured step;
    the steps planned and completed are in the record either way."""
    if record["status"].startswith("skipped"):
        return record
    warmup = getattr(args, f"{side}_warmup")
    record = record | summarize(steps, warmup, args.completions, args.prompt_len) | {
        "warmup_steps": warmup, "planned_steps": warmup + getattr(args, f"{side}_steps"), "completed_steps": len(steps)}
    measured = steps[warmup:]
    if not measured:
        return record
    if record["status"] == "timeout":
        record["status"] = "partial"
    out = {"tokens_per_s_per_gpu": record.get("tokens_per_s")}
    if "raw_timing" in measured[-1]:
        out["raw_timing_s"] = {k: round(statistics.mean(s["raw_timing"].get(k, 0.0) for s in measured), 4)
                               for k in measured[-1]["raw_timing"]}
    update = record.get("phase_s", {}).get("update")
    if update:
        seq = args.prompt_len + args.completion_len
        out["update_mfu"] = round(update_mfu(shape, args.completions, seq, update, args.peak_flops), 6)
    return record | out | rollout_numbers(record, probe, args.completions)


def wait_gpu_free(limit_s: float = 30.0, free_mb: int = 2048) -> str:
    """Wait (at most limit_s) until the GPU holds under free_mb: a side's processes release it asynchronously."""
    deadline = time.monotonic() + limit_s
    while True:
        used = _gpu_memory_used()
        mb = int(used.split()[0]) if used.split() and used.split()[0].isdigit() else 0
        if mb < free_mb or time.monotonic() > deadline:
            return used
        time.sleep(2)


def table(report: dict) -> str:
    runs = report["runs"]
    base = runs.get("verl", {}).get("tokens_per_s")
    lines = ["| run | status | measured steps | step s | mean completion | tokens/s/GPU | vs verl "
             "| rollout tok/s (vs own Engine) | update MFU | phases (mean s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base:.2f}x" if tps and base else ""
        rollout = f"{r['rollout_tokens_per_s']:.0f}" if r.get("rollout_tokens_per_s") else ""
        if r.get("rollout_vs_engine"):
            rollout += f" ({r['rollout_vs_engine']:.2f})"
        mfu = f"{100 * r['update_mfu']:.1f}%" if r.get("update_mfu") is not None else ""
        phases = ", ".join(f"{k} {v:.3g}" for k, v in r.get("phase_s", {}).items())
        status = r["status"]
        if r.get("completed_steps", 0) < r.get("planned_steps", 0):
            status += f" ({r['completed_steps']} of {r['planned_steps']} steps)"
        lines.append(f"| {name} | {status} | {r.get('measured_steps', 0)} | {r.get('mean_step_s', '')} "
                     f"| {r.get('response_length', '')} | {tps or ''} | {ratio} | {rollout} | {mfu} | {phases} |")
    for name, probe in report.get("probes", {}).items():
        if name not in runs:  # an Engine probed without its side
            lines.append(f"| {name}'s sglang.Engine alone | {probe['status']} | | | | | | "
                         f"{probe.get('generated_tokens_per_s', '')} | | |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p, smoke="CPU: tiny model, megarl with the HF engine; verl and the Engine probes are skipped "
                               "(CUDA only), verl's config written", budget_s=540)
    add_workload_arguments(p)
    p.add_argument("--runs", default="verl,megarl", help="which sides, comma-separated: verl, megarl")
    p.add_argument("--verl-site", default="/tmp/site-verl", help="verl's site directory (build_verl_chunk.sh's "
                                                                 "chunks + the bundle's ray); first on its PYTHONPATH")
    p.add_argument("--megarl-site", default="/tmp/site", help="megarl's site directory (the bundle's chunks)")
    p.add_argument("--completions", type=int, default=256, help="completions per step, both sides")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, each side (left out of the numbers)")
    p.add_argument("--steps", type=int, default=3, help="measured steps, each side")
    for side in ("verl", "megarl"):  # a slower side (verl at 1.5B) may need fewer steps to fit its call
        p.add_argument(f"--{side}-warmup", type=int, help=f"{side}'s warm-up steps (default --warmup)")
        p.add_argument(f"--{side}-steps", type=int, help=f"{side}'s measured steps (default --steps)")
    p.add_argument("--offload", default="never", choices=("auto", "always", "never"),
                   help="megarl's trainer.offload_between_phases (verl: no param/optimizer offload either); 3B on "
                        "one H200 needs auto, megarl's default: with never its update does not fit beside SGLang")
    p.add_argument("--megarl-old-logprobs", default="auto", choices=("auto", "always"),
                   help="megarl's algorithm.recompute_old_logprobs; always = verl's extra forward, like for like")
    p.add_argument("--verl-strategy", default="fsdp2", choices=("fsdp", "fsdp2"),
                   help="verl's actor strategy (its docs recommend fsdp2)")
    p.add_argument("--verl-grad-ckpt", action="store_true", help="verl's gradient checkpointing (megarl: none)")
    p.add_argument("--verl-fused-kernels", default="torch", choices=("torch", "triton", "off"),
                   help="verl's fused LM head + log-probs (model.use_fused_kernels) and its backend; off = verl's "
                        "default, whose log-probs loop over every token without flash-attn")
    p.add_argument("--probe", default="verl,megarl", help="sides whose SGLang version the bare Engine is timed "
                                                          "for ('' = none; a side not in --runs: its Engine alone)")
    p.add_argument("--probe-rounds", type=int, default=2,
                   help="timed Engine rounds with log-probs, and as many without, after one warm-up round")
    p.add_argument("--peak-flops", type=float, default=989e12, help="per-GPU peak the MFU divides by (H100/H200 bf16)")
    p.add_argument("--probe-cap-s", type=float, default=150, help="most seconds one Engine probe may take (it runs "
                                                                  "before its system and pays SGLang's JIT builds)")
    p.add_argument("--verl-cap-s", type=float, default=240, help="most seconds verl may take (megarl gets the rest)")
    # the probe's own process (--probe-only, started by run_probe) and verl's preflight (--verl-check, by run_verl)
    p.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--verl-check", action="store_true", help=argparse.SUPPRESS)  # verl_check, in verl's stack
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--probe-out", help=argparse.SUPPRESS)
    smoke_sizes(p, argv, completions=8, warmup=1, steps=1, probe="")
    args = p.parse_args(argv)
    check_completions(args, args.completions)
    for side in ("verl", "megarl"):  # (megarl_warmup, megarl_steps: the names e2e_vs_trl.megarl_command reads)
        for what in ("warmup", "steps"):
            if getattr(args, f"{side}_{what}") is None:
                setattr(args, f"{side}_{what}", getattr(args, what))
        if getattr(args, f"{side}_steps") < 1:
            raise SystemExit(f"--{side}-steps must be >= 1")
    return args


def side_env(site: str, smoke: bool) -> dict:
    """The environment of one side's processes: its own site directory first, then this checkout; nothing of the
    other side's site directory (the two stacks never share a process)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.startswith("/tmp/site")]
    env["PYTHONPATH"] = os.pathsep.join(([] if smoke else [site]) + [str(ROOT)] + inherited)
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe_only:
        return engine_probe(args)
    if args.verl_check:
        return verl_check(args)
    deadline, out, device, work, model_dir = start_run(args)
    t0 = time.monotonic()
    shape = model_shape(args.model, args.smoke)
    # the one tokenizer of both sides; verl's chat-formatted prompt = megarl's plain text, the same tokens
    words = build_model(model_dir, shape, device, special_tokens=QWEN_CHAT_TOKENS, chat_template=PLAIN_CHAT_TEMPLATE)
    prompts, val = work / "prompts.jsonl", work / "val.jsonl"
    write_prompts(prompts, words, 1024, args.prompt_len, seed=1)
    write_prompts(val, words, args.val_size, args.prompt_len, seed=2)
    problems = model_dir_problems(model_dir, json.loads(prompts.read_text().splitlines()[0])["prompt"],
                                  args.prompt_len, args.completion_len)
    if problems:
        raise SystemExit("e2e_vs_verl: the model directory does not meet verl's requirements:\n  " +
                         "\n  ".join(problems))
    params = sum(_parameter_counts(model_dir).values())
    seq = args.prompt_len + args.completion_len
    report = {"benchmark": "e2e_vs_verl", **environment(device), "device": device,
              "setup": {"model": "smoke" if args.smoke else args.model, "shape": shape, "parameters": params,
                        "prompt_len": args.prompt_len, "completion_len": args.completion_len,
                        "n_samples": args.n_samples, "completions": args.completions,
                        "micro_batch_tokens": args.micro_batch * seq, "reward": "vowel_share",
                        "reference_model": False, "updates_per_step": 1,
                        "steps": {side: {"warmup": getattr(args, f"{side}_warmup"),
                                         "measured": getattr(args, f"{side}_steps")} for side in ("verl", "megarl")},
                        "megarl_offload": args.offload, "megarl_old_logprobs": args.megarl_old_logprobs,
                        "verl_strategy": args.verl_strategy, "verl_grad_ckpt": args.verl_grad_ckpt,
                        "verl_fused_kernels": args.verl_fused_kernels,
                        "verl_remove_padding": False, "attention_backend": "triton (both SGLang versions)",
                        "model_build_s": round(time.monotonic() - t0, 1)},
              "unmatched": UNMATCHED, "runs": {}, "probes": {}}
    result_file = out / "e2e_vs_verl.json"

    def save():
        result_file.write_text(json.dumps(report, indent=1))

    envs = {"verl": side_env(args.verl_site, args.smoke), "megarl": side_env(args.megarl_site, args.smoke)}
    probes = {s for s in args.probe.split(",") if s} if device == "cuda" else set()
    sides = [s for s in ("verl", "megarl") if s in args.runs.split(",")]
    started = []
    try:  # a side named in --probe alone: its Engine only (at 3B a side and its probe do not fit one call)
        for side in [s for s in ("verl", "megarl") if s in sides or s in probes]:
            if side in probes:  # first, in a slice of its own (a system stopped at its cap cannot take it); it pays
                # SGLang's JIT builds (triton kernels, CUDA graphs), which its system then finds built
                cap = min(args.probe_cap_s, deadline - time.monotonic() - STOP_GRACE_S)
                if cap > 30:
                    print(f"== sglang.Engine in {side}'s stack: {args.completions} completions, up to {cap:.0f} s",
                          flush=True)
                    report["probes"][side] = run_probe(args, side, envs[side], model_dir, prompts, out, cap)
                    report["probes"][side]["gpu_memory_used_after"] = wait_gpu_free()
                    save()
            if side not in sides:
                continue
            left = deadline - time.monotonic() - STOP_GRACE_S
            cap = min(left, args.verl_cap_s) if side == "verl" and "megarl" in sides else left
            print(f"== {side}: {args.completions} completions/step, {getattr(args, f'{side}_warmup')} warm-up + "
                  f"{getattr(args, f'{side}_steps')} measured steps, up to {cap:.0f} s", flush=True)
            started.append(side)
            if side == "verl":
                record, steps = run_verl(args, envs["verl"], model_dir, work, out, cap)
            else:
                record, steps = run_megarl(args, envs["megarl"], model_dir, work, out, cap, device)
            if device == "cuda":
                record["gpu_memory_used_after"] = wait_gpu_free()
            record = report["runs"][side] = side_record(args, side, shape, record, steps,
                                                        report["probes"].get(side, {}))
            save()
            print(f"   {record['status']}: {record.get('completed_steps', 0)} of {record.get('planned_steps', 0)} "
                  f"steps, step s {record.get('step_s')}, tokens/s {record.get('tokens_per_s')}", flush=True)
            if record["status"] in ("failed", "timeout", "partial"):
                print("   | " + "\n   | ".join((out / record["log"]).read_text(errors="replace").splitlines()[-15:]))
    finally:  # also when this script is stopped (SIGTERM from `timeout`): the JSON and the table of what completed
        for side in started:
            if side not in report["runs"]:  # the side that was running
                report["runs"][side] = side_record(args, side, shape, {"status": "interrupted"},
                                                   side_steps(side, work), report["probes"].get(side, {}))
        verl = report["runs"].get("verl", {}).get("tokens_per_s")
        megarl = report["runs"].get("megarl", {}).get("tokens_per_s")
        report["megarl_vs_verl"] = round(megarl / verl, 3) if verl and megarl else None
        save()
        print(f"\nresults: {result_file}\n{report['gpu']}; {report['setup']['model']} ({params / 1e9:.2f}B params), "
              f"prompt {args.prompt_len} + completion {args.completion_len} tokens, {args.n_samples} per prompt, "
              f"{args.completions} completions/step; megarl/verl step throughput: {report['megarl_vs_verl']}\n")
        print(table(report), flush=True)
    usable = ("ok", "partial")
    return 0 if all(r["status"] in usable or r["status"].startswith("skipped") for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

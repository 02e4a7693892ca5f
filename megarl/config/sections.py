"""The typed sections of a run's config: every option a dataclass field with a default and a one-line help.

`Config` holds the sections side by side; its checks across them are in megarl/config/validation.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# the algorithm and rollout sections live in their own module; importable from here as every section is
from megarl.config.algorithm_sections import AlgorithmConfig, RolloutConfig, RolloutCorrectionConfig  # noqa: F401
from megarl.config.fields import CLUSTER, MEBIBYTES, PASSES, SECONDS, SEQUENCES, TOKENS, opt, section
from megarl.config.gateway_section import GatewayConfig
from megarl.config.validation import PACKING_LAYOUTS, ConfigChecks

BUILT_IN_VAL_SIZE = 256  # held-out prompts of a built-in task at data.val_size=0 (it can draw any number)

# upper bounds of the sections below, each saying what it protects (megarl/config/fields.py has the shared ones)
TINY = {"max": 65536, "why": "the built-in tiny model is for tests and CPU runs, and is built in memory at that size"}
PIXELS = {"max": 100_000_000, "why": "the bound against typos: an image resized to that many pixels exhausts memory"}
AHEAD = {"max": 1000, "why": "the bound against typos: the rollout may run that many step-batches ahead, each held in "
                            "memory"}


@dataclass
class ModelConfig:
    path: str = opt("", "HF model directory (config.json, safetensors, tokenizer), or 'tiny' to build the built-in "
                        "tiny Qwen2 model offline under trainer.output_dir; required")
    tiny_hidden_size: int = opt(64, "hidden size of the built-in tiny model", min=1, **TINY)
    tiny_num_layers: int = opt(2, "layers of the built-in tiny model", min=1, **TINY)
    tiny_num_heads: int = opt(4, "attention heads of the built-in tiny model", min=1, **TINY)
    tiny_num_kv_heads: int = opt(2, "key/value heads of the built-in tiny model (GQA)", min=1, **TINY)
    tiny_tie_embeddings: bool = opt(True, "tie input and output embeddings of the built-in tiny model")
    tiny_intermediate_size: int = opt(0, "MLP (FFN) width of the built-in tiny model; 0 = the builder's default",
                                      min=0, **TINY)
    tiny_vocab_multiple: int = opt(1, "pad the built-in tiny model's vocabulary (embedding rows past the tokenizer's) "
                                      "to a multiple of this, as real checkpoints do; rollout.weight_delivery=sharded "
                                      "into SGLang needs a multiple of 64 x rollout.sglang_tp", min=1, **TINY)


@dataclass
class ParallelConfig:
    world_size: int = opt(1, "training ranks (one process each; one GPU each on GPU)", min=1, **CLUSTER)
    tp: int = opt(1, "tensor-parallel size", min=1, **CLUSTER)
    pp: int = opt(1, "pipeline-parallel size", min=1, **CLUSTER)
    ep: int = opt(1, "expert-parallel size (mixture-of-experts models): experts split over this many DP ranks",
                  min=1, **CLUSTER)
    etp: int = opt(0, "expert-tensor-parallel size (megatron's expert_tensor_parallel_size): each expert's weights "
                      "split over this many ranks, independently of tp (e.g. 1: whole experts beside TP-split "
                      "attention); ep * etp must divide the ranks of a pipeline stage (tp * cp * dp); 0 = tp",
                   min=0, **CLUSTER)
    pp_first_stage_layers: int = opt(0, "decoder layers on the first pipeline stage (megatron's "
                                        "num_layers_in_first_pipeline_stage), for layer counts pp does not divide "
                                        "(61 over pp=8: 5, with pp_last_stage_layers=8); the stages between "
                                        "first and last split the rest evenly; 0 = an even share", min=0)
    pp_last_stage_layers: int = opt(0, "decoder layers on the last pipeline stage (megatron's "
                                       "num_layers_in_last_pipeline_stage); 0 = an even share", min=0)
    vpp: int = opt(1, "virtual pipeline stages per pipeline rank (interleaved 1F1B, needs pp > 1); 1 = off", min=1)
    cp: int = opt(1, "context-parallel size: every row split over this many ranks by sequence (2 * cp chunks, "
                     "row width padded to a multiple of 2 * cp), keys and values all-gathered for attention "
                     "(attention=sdpa; no TransformerEngine needed); not with ep > 1", min=1, **CLUSTER)
    sequence_parallel: bool = opt(False, "sequence parallelism over the TP group: norms, dropout and the MoE router "
                                         "run on 1/TP of the tokens (needs TP > 1: refused at TP 1; row width padded "
                                         "to a multiple of TP); required for mixture-of-experts training at TP > 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def describe(self) -> str:
        """The layout as the start-up line prints it, e.g. 'world_size=4 = tp 1 x pp 2 x cp 1 x dp 2 (ep 2, last
        stage 1 layers)': expert parallelism and uneven stages in brackets, when set."""
        extras = [f"ep {self.ep}"] * (self.ep > 1) + [f"vpp {self.vpp}"] * (self.vpp > 1)
        extras += [f"{which} stage {n} layers" for which, n in (("first", self.pp_first_stage_layers),
                                                                 ("last", self.pp_last_stage_layers)) if n]
        layout = f"world_size={self.world_size} = tp {self.tp} x pp {self.pp} x cp {self.cp} x dp {self.dp}"
        return layout + (f" ({', '.join(extras)})" if extras else "")


@dataclass
class OptimConfig:
    lr: float = opt(1e-5, "peak learning rate", min=0)
    min_lr: float = opt(0.0, "learning rate at the end of the decay", min=0)
    warmup_steps: int = opt(0, "linear warmup steps", min=0)
    decay_style: str = opt("constant", "learning-rate decay after warmup: constant, linear or cosine",
                           choices=("constant", "linear", "cosine"))
    weight_decay: float = opt(0.0, "AdamW weight decay", min=0)
    adam_beta1: float = opt(0.9, "Adam beta1", min=0, max=1, max_exclusive=True)
    adam_beta2: float = opt(0.999, "Adam beta2", min=0, max=1, max_exclusive=True)
    adam_eps: float = opt(1e-8, "Adam epsilon", min=0, min_exclusive=True)
    clip_grad: float = opt(1.0, "gradient clipping by global norm; 0 = off", min=0)


@dataclass
class EngineConfig:
    """The keys every training role's engine reads (megarl/engine/megatron_engine.py): layout, optimizer,
    micro-batches, precision, kernels. Each role's section adds its own keys."""
    parallel: ParallelConfig = section(ParallelConfig, "training layout of the model")
    optim: OptimConfig = section(OptimConfig, "optimizer of the model")
    micro_batch_size: int = opt(8, "sequences per micro-batch in forward/backward", min=1, **SEQUENCES)
    mini_batch_size: int = opt(0, "sequences per optimizer step; 0 = the whole step's batch in one update",
                               min=0, **SEQUENCES)
    precision: str = opt("auto", "auto (bf16 on GPU, fp32 on CPU), bf16 or fp32", choices=("auto", "bf16", "fp32"))
    use_distributed_optimizer: bool = opt(False, "megatron's distributed optimizer: optimizer state and fp32 main "
                                                 "weights sharded over data-parallel ranks")
    optimizer_cpu_offload: bool = opt(False, "megatron's optimizer CPU offload (HybridDeviceOptimizer): Adam's "
                                             "moments (of optimizer_offload_fraction of the parameters) live in host "
                                             "memory and the update runs there (torch AdamW); the fp32 main weights "
                                             "stay on the GPU (megatron moves them too only through its "
                                             "TransformerEngine path). Needs use_distributed_optimizer; no "
                                             "checkpoints (trainer.save_every=0); on the CPU it changes nothing")
    optimizer_offload_fraction: float = opt(1.0, "with optimizer_cpu_offload: the fraction of the parameters "
                                                 "(by size) whose optimizer state is on the CPU",
                                            min=0, max=1, min_exclusive=True)
    max_tokens_per_micro_batch: int = opt(0, "pack whole sequences (no padding) into micro-batches of at most this "
                                             "many tokens, balanced over DP ranks by tokens; 0 = as many as "
                                             "micro_batch_size rows of the longest sequence (packing=one_row with "
                                             "attention varlen), else micro_batch_size padded rows", min=0, **TOKENS)
    packing: str = opt("one_row", "micro-batch layout: one_row (one row of max_tokens_per_micro_batch tokens, at 0 "
                                  "micro_batch_size x the longest sequence of the batch where attention is varlen, the "
                                  "GPU's auto, padded rows under a dense mask; holding any number of whole "
                                  "sequences; without pipeline stages cut to its used length rounded up to 64; a "
                                  "longer sequence is an error) or rows (rows as wide as the longest sequence, "
                                  "max_tokens_per_micro_batch // that many per micro-batch, at 0 micro_batch_size "
                                  "padded rows: to reproduce runs made before one_row became the default, or compare "
                                  "layouts)", choices=PACKING_LAYOUTS)
    recompute: str = opt("none", "activation recompute: none, full (each layer's activations) or selective "
                                 "(the modules in recompute_modules)", choices=("none", "full", "selective"))
    recompute_modules: list = opt([], "recompute=selective: megatron's modules to recompute in the backward pass: "
                                      "core_attn, moe (the whole MoE layer), shared_experts, mlp (dense MLPs), "
                                      "and with TransformerEngine installed mla_up_proj (MLA models) and layernorm; "
                                      "empty = [core_attn]")
    attention: str = opt("auto", "core attention: auto (varlen on GPU, local on CPU), varlen (PyTorch SDPA; packed "
                                 "rows by flash attention over cu_seqlens, aten's kernels), sdpa "
                                 "(PyTorch SDPA; packed rows by a block-diagonal mask, no flash kernel) or local "
                                 "(megatron's unfused DotProductAttention)",
                         choices=("auto", "varlen", "sdpa", "local"))
    fused_kernels: bool = opt(True, "on GPU: SwiGLU and RoPE each one kernel (megarl's Triton kernels through "
                                    "megatron's bias_activation_fusion and apply_rope_fusion, the latter where "
                                    "TransformerEngine is absent), and the weight gradients' GEMMs adding into "
                                    "the float32 main_grad (gradient_accumulation_fusion); false: megatron's unfused "
                                    "torch ops. The CPU always runs them unfused")
    moe_router_bias_update_rate: float = opt(0.0, "DeepSeek-V3's aux-loss-free load balancing (megatron's "
                                                  "moe_router_enable_expert_bias): after each optimizer update every "
                                                  "MoE layer's e_score_correction_bias moves by this rate towards even "
                                                  "expert load and is synced to the rollout engine like a weight; "
                                                  "0 = off, the default for RL (routing keeps the checkpoint's bias; "
                                                  "DeepSeek-V3's pre-training used 1e-3)", min=0)
    freeze_vision_tower: bool = opt(False, "vision-language models (Qwen2.5-VL): the vision tower is not trained "
                                           "(no gradients, no optimizer state); the language model is")


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank r of every adapter (A: r x in, B: out x r) on the policy's linear layers: the base "
                       "weights are frozen and only the adapters train; 0 = off (full fine-tuning)", min=0,
                    max=65536, why="the bound against typos: a rank past any layer's width adapts nothing more")
    alpha: float = opt(16.0, "LoRA scale numerator: each adapted layer computes W x + (alpha / rank) B A x",
                       min=0, min_exclusive=True, max=1e6, why="the bound against typos: the adapters' update is "
                                                                  "scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout probability on each adapter's input during training (the base layer sees "
                              "its input whole)", min=0, max=1, max_exclusive=True)
    target_modules: list = opt(["all-linear"], "the projections that get adapters, by the checkpoint's names: "
                                               "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or "
                                               "all-linear (all of them; the output layer never)")
    peft_dir: str = opt("", "at the end of the run, write the adapters as a PEFT adapter directory there "
                            "(adapter_config.json, adapter_model.safetensors: docs/lora.md); '' = none")


@dataclass
class ActorConfig(EngineConfig):
    parallel: ParallelConfig = section(ParallelConfig, "training layout of the policy")
    optim: OptimConfig = section(OptimConfig, "optimizer of the policy")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters (LoRA) on the frozen policy (docs/lora.md)")
    ppo_epochs: int = opt(1, "passes of the policy over each step's batch", min=1, **PASSES)
    fp32_lm_head: bool = opt(True, "under bf16: the output layer (the vocabulary projection) and the log-softmax "
                                   "in float32, and the rollout engine's too (SGLang's --enable-fp32-lm-head, the "
                                   "hf engine's lm_head): rollout and training log-probs closer (SmolLM2-135M on an "
                                   "H100: k3 KL 1.65e-3 -> 7.93e-4 per token; docs/benchmarks.md, A real pretrained "
                                   "model); the logits take twice the memory of bf16's. No effect at fp32")
    router_replay: str = opt("off", "mixture-of-experts policies: rollout = rollout routing replay (R3): the rollout "
                                    "engine records the experts it routed every token to (SGLang's "
                                    "--enable-return-routed-experts, the hf engine's gates) and megatron's routers use "
                                    "exactly those in the old-log-prob and training forwards, so the gradient is the "
                                    "sampling network's; off = the trainer routes for itself",
                             choices=("off", "rollout"))


@dataclass
class CriticConfig(EngineConfig):
    parallel: ParallelConfig = section(ParallelConfig, "training layout of the critic")
    optim: OptimConfig = section(OptimConfig, "optimizer of the critic")
    ppo_epochs: int = opt(1, "passes of the critic over each step's batch", min=1, **PASSES)
    path: str = opt("", "the critic's HF directory; empty = the policy's (model.path) with a zero-initialised "
                        "value head")
    value_clip: float = opt(0.5, "PPO value clipping: new values stay within this of the values before the step; "
                                 "0 = no clipping", min=0)


@dataclass
class RewardModelConfig(EngineConfig):
    parallel: ParallelConfig = section(ParallelConfig, "layout of the reward model's ranks (training in "
                                                       "python -m megarl.train_rm, scoring in RL)")
    optim: OptimConfig = section(OptimConfig, "optimizer of the reward model (python -m megarl.train_rm)")
    path: str = opt("", "reward model HF directory (a value head, score.weight, read at the last token); empty = "
                        "the rule reward (reward.name). python -m megarl.train_rm writes the model it trains here "
                        "(empty: <trainer.output_dir>/reward_model)")
    normalize: str = opt("none", "RL: the reward model's scores before mixing: none, running (minus the running mean, "
                                 "over the running std, of every score so far; kept in checkpoints) or group (minus "
                                 "the mean, over the std, of the prompt's group of samples)",
                         choices=("none", "running", "group"))
    weight: float = opt(1.0, "RL: a sample's reward = weight * its (normalised) reward-model score + rule_weight * "
                             "its rule reward", unbounded=True)
    rule_weight: float = opt(0.0, "RL: weight of the rule reward (reward.name, or the task's own) mixed in; 0 = the "
                                  "reward model's score alone (the rule reward is still logged: train/rule_reward)",
                             unbounded=True)
    missing_eos_penalty: float = opt(0.0, "RL: subtracted from the reward model's score of a response that does not "
                                          "end with the tokenizer's EOS token (cut at rollout.max_new_tokens), before "
                                          "normalising: a reward model never trained on unfinished text can score "
                                          "it high, and a policy then learns not to stop (TRL's missing_eos_penalty)",
                                     min=0)


@dataclass
class AgentConfig:
    """Multi-turn, tool-using rollouts (megarl/rollout/agent.py), for training and evaluation."""
    enabled: bool = opt(False, "roll out with the multi-turn agent loop (tool calls between model turns) instead of "
                               "one generation per sample")
    tools: list = opt([], "tools the model may call: registry names (calculator, python, retrieval) or "
                          "package.module:Class, or {name: ..., <constructor options>} dicts")
    parser: str = opt("auto", "tool-call parser: auto (the format the tokenizer's chat template writes; hermes if it "
                              "shows none), hermes (Qwen2.5/Qwen3), llama3, harmony (gpt-oss), deepseek, mistral, or "
                              "package.module:function")
    max_turns: int = opt(4, "model turns per conversation", min=1)
    max_response_tokens: int = opt(1024, "token budget of everything after the prompt: model turns and tool results",
                                   min=1, **TOKENS)
    max_new_tokens_per_turn: int = opt(256, "tokens one model turn may generate", min=1, **TOKENS)
    max_tool_calls_per_turn: int = opt(4, "tool calls run per turn; further ones are ignored", min=1)
    tool_timeout_s: float = opt(10.0, "a tool call running longer becomes an error observation",
                                min=0, min_exclusive=True, **SECONDS)
    max_observation_chars: int = opt(1024, "each tool result is cut to this many characters before rendering", min=1)
    max_concurrent: int = opt(64, "conversations in flight at once", min=1)
    observation_template: str = opt("", "how tool results are rendered, as text with a {result} field (one per "
                                        "call); empty = the tokenizer's chat template (tool messages), or "
                                        "'\\n<tool_response>\\n{result}\\n</tool_response>\\n' without one")
    oversample_groups: int = opt(0, "over-sampling: start this many groups more than data.prompts_per_step and "
                                    "abort the rest once enough are complete (with algorithm.dynamic_sampling, "
                                    "only groups whose rewards differ count); 0 = off", min=0, **SEQUENCES)
    partial: str = opt("resume", "over-sampling: what happens to the aborted groups' unfinished conversations: "
                                 "resume (continued in the next step, keeping their policy_version) or drop",
                       choices=("resume", "drop"))
    gateway: GatewayConfig = section(GatewayConfig, "rollouts by your own agent code through an OpenAI-compatible "
                                                    "endpoint (docs/agents.md)")


@dataclass
class DataConfig:
    task: str = opt("", "the training prompts: a .jsonl/.parquet prompt file, or a built-in synthetic task (reverse, "
                        "add) for the tiny model's CPU runs; required")
    val_task: str = opt("", "held-out prompt file; empty = a held-out split of the built-in task")
    prompts_per_step: int = opt(64, "prompts per RL step (counts PROMPTS, not responses: a step trains on "
                                   "prompts_per_step x rollout.n_samples sequences)", min=1, **SEQUENCES)
    max_prompt_length: int = opt(0, "most tokens of a rendered prompt (verl's data.max_prompt_length); a longer "
                                    "prompt is handled by data.truncation, or left out with "
                                    "data.filter_overlong_prompts; 0 = what the model's positions leave after "
                                    "the response budget", min=0, **TOKENS)
    filter_overlong_prompts: bool = opt(False, "leave out (and count, naming the first) the prompts longer than "
                                               "data.max_prompt_length instead of applying data.truncation")
    truncation: str = opt("error", "a prompt longer than data.max_prompt_length: error (names the file and row), "
                                   "left (keeps its last tokens), right (its first) or middle (its first and last "
                                   "halves)", choices=("error", "left", "right", "middle"))
    val_size: int = opt(0, "held-out prompts scored at each evaluation (the first this many); 0 = every one: every "
                           "row of the held-out file (data.val_task, or the held-out split of data.task's file), or "
                           f"{BUILT_IN_VAL_SIZE} prompts of a built-in task", min=0, **SEQUENCES)
    min_len: int = opt(3, "built-in tasks: shortest operand", min=1, **TOKENS)
    max_len: int = opt(5, "built-in tasks: longest operand", min=1, **TOKENS)
    chat_template: bool = opt(True, "render prompts with the tokenizer's chat template (a string prompt becomes "
                                    "one user message; a prompt given as a list of messages always is rendered); a "
                                    "tokenizer without one is an error naming this key: false feeds prompts as they "
                                    "are")
    system_prompt: str = opt("", "with chat_template: a system message put before each prompt; empty = none")
    skip_malformed: bool = opt(False, "prompt files: skip (and count) malformed rows instead of stopping with an "
                                      "error that names the file and row")
    prompt_key: str = opt("prompt", "prompt files: the field that holds the prompt (a string or chat messages), e.g. "
                                    "problem for Geometry3K's HF layout")
    min_pixels: int = opt(0, "prompt rows with images: each image is resized to at least this many pixels (sides "
                             "multiples of patch_size x merge_size, as transformers' smart_resize); 0 = the model "
                             "directory's preprocessor_config.json", min=0, **PIXELS)
    max_pixels: int = opt(0, "prompt rows with images: each image is resized to at most this many pixels (fewer "
                             "pixels, fewer image tokens); 0 = the model directory's preprocessor_config.json",
                          min=0, **PIXELS)


@dataclass
class RewardConfig:
    name: str = opt("", "reward function: registry name (gsm8k, gsm8k_flexible, math, math_dapo, geo3k, qa_em, "
                        "countdown, code, remote, data_source, ...), package.module:function or "
                        "path/to/file.py:function (a function with verl's compute_score signature is called as verl "
                        "calls it); empty = the built-in task's own, or for a prompt file each row's data_source "
                        "(verl's default scorer)")
    timeout_s: float = opt(30.0, "a reward call running longer scores 0 and is counted as failed; 0 = no limit",
                           min=0, **SECONDS)
    batch_timeout_s: float = opt(1800.0, "a batch's reward calls all together: calls not finished when it runs out "
                                         "score 0 and are counted as failed; 0 = no limit", min=0, **SECONDS)
    num_workers: int = opt(1, "reward calls run at once (reward processes, or threads with isolation=none and for "
                              "remote and code rewards); 1 = one by one",
                           min=1, max=10_000, why="each is a process (or a thread): more would exhaust the host")
    isolation: str = opt("process", "where a reward function runs: process (the default, because only a process can "
                                    "be killed: a reward stuck inside a C call, which no signal or thread timeout "
                                    "interrupts, would hang the run; the call's process is killed and replaced at "
                                    "timeout_s) or none (the driver's process: for rewards that cannot be pickled, "
                                    "e.g. closures or objects holding locks); remote, code and reward-model rewards "
                                    "bound their own calls and always run in the driver", choices=("process", "none"))
    worker_memory_mb: int = opt(4096, "isolation=process: resident memory of one reward process and everything it "
                                      "starts, together, measured during and after each call (also a memory cgroup "
                                      "of this size where the host allows one, else each process's address space "
                                      "capped at twice it); a call that passes it fails, named, and its process is "
                                      "replaced; one holding over 3/4 of it after a call is replaced before the next",
                                min=64, **MEBIBYTES)
    worker_max_threads: int = opt(1024, "isolation=process: threads of one reward process and every process it "
                                        "starts, together (a process counts one at least; BLAS and OpenMP pools "
                                        "count, about one per core); a call that passes it fails, named, and its "
                                        "process is replaced", min=1, max=1_000_000,
                                  why="the bound against typos: past it the host's pid space is the limit")
    worker_max_calls: int = opt(1000, "isolation=process: a reward process is replaced after this many calls (what a "
                                      "reward keeps between calls goes with it); 0 = never", min=0)
    max_failure_rate: float = opt(0.5, "stop the run (with the reward's own first error and its sample) when more "
                                       "than this fraction of reward calls failed over the last failure_window steps, "
                                       "or in one evaluation: past half, the rewards say more about the reward than "
                                       "the policy; 1 = never stop", min=0, max=1)
    failure_window: int = opt(5, "steps over which reward.max_failure_rate is judged (fewer at the start of a run); "
                                 "a longer window lets a short outage pass", min=1)
    remote_url: str = opt("", "remote reward: the URL that receives a JSON POST per sample")
    remote_timeout_s: float = opt(10.0, "remote reward: timeout of one HTTP request",
                                  min=0, min_exclusive=True, **SECONDS)
    remote_retries: int = opt(3, "remote reward: retries after a connection error, a timeout or a 5xx/429 answer",
                              min=0, max=20, why="each retry waits twice the one before: past 20 the waits run to days")
    remote_max_timeouts: int = opt(3, "remote reward: after this many requests in a row time out, the rest of the "
                                      "batch fails at once (counted, the server named); the next batch tries again",
                                   min=1)
    code_timeout_s: float = opt(5.0, "code reward: wall-clock limit of one test run in the sandbox",
                                min=0, min_exclusive=True, **SECONDS)
    code_memory_mb: int = opt(1024, "code reward: memory of one test run in the sandbox, all its processes together "
                                    "(a memory cgroup where the host allows one; else one process)", min=1, **MEBIBYTES)
    code_sandbox: str = opt("auto", "code reward: sandbox mode: auto or bwrap (bubblewrap: the program sees only its own "
                                    "files and Python, no network; a start-up error where bubblewrap does not run), "
                                    "or, without bubblewrap and knowing what they leave open (docs/failure-modes.md), "
                                    "unsafe-namespaces (host files readable by permissions: data sets too) or "
                                    "unsafe-rlimits (host files, the network and the caller reachable)",
                            choices=("auto", "bwrap", "unsafe-namespaces", "unsafe-rlimits"))


@dataclass
class PreferenceConfig:
    """Preference pairs for reward-model training (python -m megarl.train_rm; megarl/data/preferences.py)."""
    train: str = opt("reverse", "training pairs: a .jsonl/.parquet/.json file (chosen, rejected and optionally prompt: "
                                "strings or chat messages, docs/reward_model.md) or a built-in task (reverse, add, "
                                "mul; operands of data.min_len..data.max_len): chosen its answer, rejected a "
                                "corrupted one")
    val: str = opt("", "held-out pairs file; empty = a held-out split of preference.train (by a hash of the prompt)")
    val_size: int = opt(256, "held-out pairs scored at each evaluation (at most this many)", min=1, **SEQUENCES)
    task_pairs: int = opt(5000, "a built-in task in preference.train: how many training pairs are built from it",
                          min=1, **SEQUENCES)
    pairs_per_step: int = opt(32, "preference pairs per optimizer step", min=1, **SEQUENCES)
    max_length: int = opt(0, "most tokens of one side of a pair (prompt and response); a longer one is a malformed "
                             "row; 0 = the model's max_position_embeddings", min=0, **TOKENS)
    chat_template: bool = opt(False, "render a string prompt and response as a user turn and an assistant turn with "
                                     "the tokenizer's chat template (fields of chat messages always are)")
    append_eos: bool = opt(True, "end each side with the tokenizer's EOS token unless it ends so (as RL responses "
                                 "end; the score is read at the last token)")
    skip_malformed: bool = opt(False, "skip malformed rows (counted: data/skipped_pairs) instead of stopping with an "
                                      "error that names the file, row and field")


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-start steps before RL (0 = none)", min=0)
    batch_size: int = opt(32, "sequences per SFT step", min=1, **SEQUENCES)
    lr: float = opt(1e-5, "SFT learning rate", min=0)
    data: str = opt("", "SFT examples: empty = the task's reference answers; or a .jsonl of multi-turn traces "
                        "{prompt, messages: [{role: assistant|tool, content}]} (scripts/make_tool_traces.py), "
                        "trained on the assistant turns only")


@dataclass
class AsyncConfig:
    """Asynchronous training (trainer.mode one_step_off or async; megarl/async_trainer.py, docs/async.md)."""
    max_staleness: int = opt(1, "most policy versions a trained sample may lag the trainer (trainer version minus the "
                                "version of the sample's oldest token); one_step_off needs >= 1; 0 = on-policy (the "
                                "async mode then reproduces trainer.mode=sync)", min=0, **AHEAD)
    stale: str = opt("drop", "a sample group found over max_staleness when the trainer takes it: drop (skipped; the "
                             "next groups fill the batch) or regenerate (its prompt goes back to the rollout, first "
                             "in line); both are counted (async/stale_dropped, async/stale_regenerated)",
                     choices=("drop", "regenerate"))
    partial: str = opt("finish", "generation in flight at a weight update: finish (the update waits for it), resume "
                                 "(stopped, the new weights loaded, continued from its tokens: each token keeps the "
                                 "version that made it) or restart (stopped and begun again under the new weights); "
                                 "one_step_off needs finish", choices=("finish", "resume", "restart"))
    buffer_batches: int = opt(0, "step-batches the rollout may have generated or be generating ahead of the trainer's "
                                 "next one; 0 = all that max_staleness allows (max_staleness + 1); one_step_off: 1",
                              min=0, **AHEAD)
    batches_at_once: int = opt(1, "step-batches the rollout thread may generate in one engine call (trainer.mode="
                                  "async): up to this many of those the buffer admits at the moment, their prompts "
                                  "decoded together (more rows at once: more tokens per GPU-second), each put in the "
                                  "buffer with its own bound; 0 = all it admits then (at most buffer_batches); 1 = "
                                  "one at a time (one_step_off: one anyway); DAPO dynamic sampling and over-sampling "
                                  "generate one at a time", min=0, **AHEAD)
    decoupled_ppo: str = opt("auto", "the objective on samples from an older policy: decoupled PPO "
                                     "(algorithm.rollout_correction.decoupled: the PPO ratio against the trainer's "
                                     "weights before the update, the proximal policy, times the capped weight "
                                     "proximal / rollout policy, as AReaL): on, off, or auto (on from max_staleness 1 "
                                     "unless algorithm.tis, rollout_correction.rollout_is or bypass_mode already "
                                     "correct; off at 0, where async is the synchronous loop)",
                             choices=("auto", "on", "off"))


@dataclass
class TrainerConfig:
    mode: str = opt("sync", "sync (generate, then train, then sync weights, in turn), one_step_off (the rollout of "
                            "step t+1 runs while step t trains, from the policy one version older) or async (the "
                            "rollout keeps generating into a buffer; the trainer takes a batch whenever one is "
                            "ready; bounded by async.max_staleness); docs/async.md",
                    choices=("sync", "one_step_off", "async"))
    steps: int = opt(0, "RL steps; 0 = one pass over data.task's prompt file: its rows // data.prompts_per_step "
                        "(verl's epoch, its dataloader dropping the last partial batch; without data.val_task the "
                        "held-out ~10% is counted among the rows); a built-in task needs a number", min=0)
    eval_every: int = opt(10, "evaluate on the held-out set before RL, every N steps and after the last step; "
                             "0 = before RL and after the last step only", min=0)
    output_dir: str = opt("runs/default", "the runs' root: each run's metrics.jsonl and TensorBoard events go to "
                                          "<output_dir>/logs/<run id>/, checkpoints and the tiny model beside")
    seed: int = opt(1, "random seed", min=0, max=2**32 - 1)
    device: str = opt("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    threads_per_rank: int = opt(1, "torch threads per training rank (CPU)",
                                min=1, max=1024, why="more threads than any host has cores")
    profile_update: int = opt(0, "the N-th policy update (the RL step N's in the synchronous loop) runs under "
                                 "torch.profiler on every training rank: ops by GPU and by host time and a chrome "
                                 "trace in output_dir/profile/update_N_rank_R/; 0 = off", min=0)
    worker_env: dict = opt({}, "environment variables of every training process, set when its Ray actor starts "
                               "(e.g. {NCCL_DEBUG: INFO}; under CUDA MPS {CUDA_MPS_CLIENT_PRIORITY: 1} puts training "
                               "below a colocated SGLang server's generation: docs/async.md); CUDA_VISIBLE_DEVICES "
                               "is Ray's")
    cpus_per_rank: float = opt(0.5, "Ray CPUs reserved per training rank", min=0, min_exclusive=True, **CLUSTER)
    loggers: list = opt(["console", "tensorboard", "jsonl"], "where metrics go: console, tensorboard, jsonl, and "
                                                             "with their libraries installed (pip install "
                                                             "megarl[trackers]) wandb, mlflow, swanlab")
    project_name: str = opt("megarl", "the project trackers file the run under (W&B project, MLflow experiment, "
                                      "SwanLab project)")
    experiment_name: str = opt("", "the run's name in the trackers, followed by its run id; empty = the last part "
                                   "of trainer.output_dir")
    sync_bucket_mb: int = opt(1024, "weight-sync bucket size in MiB: the most extra memory a sync takes on a sending "
                                    "rank (plus SGLang's two persistent buffers of ~half a bucket each); fewer, "
                                    "larger buckets sync faster (docs/benchmarks.md, Weight sync into SGLang)", min=1,
                                **MEBIBYTES)
    verify_weight_sync_every: int = opt(1, "check the rollout engine's weights equal Megatron's bit for bit after the "
                                           "first weight sync and every N-th one after it (checksums of every "
                                           "parameter, computed inside SGLang's TP workers on their GPUs, against "
                                           "the sender's; its cost: docs/benchmarks.md, Weight-sync verification); 1: "
                                           "every sync, 0: never", min=0)
    verify_weight_sync_deep: bool = opt(False, "verification also has SGLang reload the sync from a safetensors file "
                                               "with its own loader and compare (writes the whole model each time: "
                                               "for debugging a weight layout, not for long runs)")
    offload_between_phases: str = opt("auto", "colocated memory cycle: during rollouts the training engines park "
                                              "weights, grads and optimizer state in host memory and the rollout "
                                              "engine releases its memory during training; auto (on for sglang on "
                                              "GPU), always (CPU too) or never", choices=("auto", "always", "never"))
    ray_address: str = opt("", "Ray cluster to join (IP:PORT); empty = RAY_ADDRESS, else the one `ray start` "
                               "left on this node, else a new local one; auto = join, never start; local = "
                               "always a new local one")
    placement: str = opt("pack", "how training ranks spread over Ray nodes: pack, spread or strict_spread "
                                 "(Ray placement-group strategies)", choices=("pack", "spread", "strict_spread"))
    save_every: int = opt(0, "write a checkpoint every N RL steps and after the last one; 0 = never", min=0)
    checkpoint_dir: str = opt("", "where checkpoints go; empty = <output_dir>/checkpoints")
    resume: str = opt("auto", "auto (the newest intact checkpoint in checkpoint_dir, if any, when its run had this "
                              "run's training settings: other settings are refused, naming them), force (that "
                              "checkpoint, resumed with the changed settings), none, or the path of a checkpoint (or "
                              "of a directory of checkpoints; changed settings are named, not refused); "
                              "docs/failure-modes.md")
    verify_checkpoint: str = opt("sampled", "what each checkpoint's manifest holds and a resume checks: sizes (every "
                                            "file's size), sampled (and the sha256 of files up to 1 MiB, and of 8 "
                                            "blocks of 64 KiB of each larger one) or full (the sha256 of every file "
                                            "whole: reads the whole checkpoint at each save and resume); a damaged "
                                            "checkpoint gives way to the previous one",
                                 choices=("sizes", "sampled", "full"))
    keep_last: int = opt(2, "complete checkpoints kept (older ones are deleted); 0 = keep all", min=0)
    skip_nonfinite_updates: bool = opt(False, "an optimizer update whose loss (any micro-batch, any rank) or gradient "
                                              "norm is NaN or infinite is skipped (weights and optimizer state "
                                              "untouched, the LR schedule still advances; counted in "
                                              "train/skipped_updates) instead of stopping the run with an error that "
                                              "names the step, rank and micro-batch")
    worker_timeout_s: float = opt(1800.0, "deadline in seconds for every driver call to a training rank or the "
                                          "rollout actor (a whole generate, train or checkpoint call); past it the run "
                                          "names the silent rank and the call, kills every rank and server, and "
                                          "recovers (trainer.max_restarts) or exits non-zero. 30 min: far longer "
                                          "than any healthy call (a 671B step's train or checkpoint call takes "
                                          "minutes), as long as the ranks' own collective "
                                          "timeout (megarl/parallel/state.py). 0 = wait forever", min=0, **SECONDS)
    max_restarts: int = opt(3, "in-job recoveries of a run whose training rank or rollout actor dies or misses "
                               "trainer.worker_timeout_s: the driver starts new processes, restores the newest "
                               "complete checkpoint (trainer.save_every) and goes on; past this many the run stops "
                               "naming the fault. trainer.mode=sync (the asynchronous modes stop on the fault); 0 = "
                               "stop on the first (docs/failure-modes.md)", min=0)


# the sections of the training roles: each an EngineConfig plus the keys of its own
TRAINING_ROLES = ("actor", "critic", "reward_model")


@dataclass
class Config(ConfigChecks):
    model: ModelConfig = section(ModelConfig, "policy model")
    # a real run's optimizers (verl's: the policy's lr 1e-6, the critic's 1e-5, both with AdamW weight decay 0.01)
    actor: ActorConfig = section(ActorConfig, "policy training", optim={"lr": 1e-6, "weight_decay": 0.01})
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and losses")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    data: DataConfig = section(DataConfig, "prompts")
    reward: RewardConfig = section(RewardConfig, "reward")
    critic: CriticConfig = section(CriticConfig, "the critic (algorithm.advantage=gae): its own layout and optimizer",
                                   optim={"weight_decay": 0.01})
    reward_model: RewardModelConfig = section(RewardModelConfig, "a reward model: the one python -m megarl.train_rm "
                                                                 "trains, or RL's (when reward_model.path is set)")
    agent: AgentConfig = section(AgentConfig, "multi-turn, tool-using rollouts")
    sft: SFTConfig = section(SFTConfig, "supervised warm start")
    preference: PreferenceConfig = section(PreferenceConfig, "preference pairs for reward-model training "
                                                             "(python -m megarl.train_rm)")
    trainer: TrainerConfig = section(TrainerConfig, "the loop")
    # `async` is a Python keyword: the field is async_, its key in recipes and overrides `async` (loading.py)
    async_: AsyncConfig = section(AsyncConfig, "asynchronous training (trainer.mode one_step_off or async)")
    # how load_config read the command (class attributes, not options): the vocabulary ("megarl" or "verl"), the
    # megarl keys the command set (itself or through verl's keys; None for a Config built in code), and notes said
    # at start-up, and {megarl key: the verl or former key and value the user typed for it} for error messages
    profile = "megarl"
    given = None
    notes = ()
    origins = {}

    def old_policy_is_the_trained_one(self) -> bool:
        """One optimizer update per step and nothing reading the old log-probs before it: the policy the
        update starts from is the old policy, so its training forward gives the old log-probs (detached)."""
        batch = self.data.prompts_per_step * self.rollout.n_samples
        one_update = self.actor.ppo_epochs == 1 and self.actor.mini_batch_size in (0, batch)
        return one_update and not (self.algorithm.kl_coef > 0 and self.algorithm.kl_in_reward)

    def recompute_old_logprobs(self) -> bool:
        """Whether the step runs a forward pass of its own for the old log-probs (algorithm.recompute_old_logprobs).
        Never in the rollout correction's bypass mode (the rollout's are the old ones); always for its weights and
        rejection otherwise (computed on the whole batch before training)."""
        mode, rc = self.algorithm.recompute_old_logprobs, self.algorithm.rollout_correction
        if rc.bypass_mode:
            return False
        needed = not self.old_policy_is_the_trained_one() or rc.rollout_is != "none" or rc.rollout_rs != "none"
        return mode == "always" or (mode == "auto" and needed)

    def sglang_colocated(self) -> bool:
        """SGLang servers on the training GPUs (no rollout.sglang_gpus of their own)."""
        return self.rollout.engine == "sglang" and not self.rollout.sglang_gpus

    def offload_enabled(self, device: str) -> bool:
        """The colocated memory cycle (trainer.offload_between_phases; megarl/workers/colocation.py). auto: on where
        training and SGLang share GPUs (SGLang runs colocated: no rollout.sglang_gpus of its own); always/never as
        said; never in the asynchronous modes, which keep both engines resident (always is refused there)."""
        mode = self.trainer.offload_between_phases
        if self.trainer.mode != "sync":
            return False
        if mode == "auto":
            return self.sglang_colocated() and device == "cuda"
        return mode == "always"

    def to_dict(self) -> dict:
        return {name.rstrip("_"): value for name, value in dataclasses.asdict(self).items()}

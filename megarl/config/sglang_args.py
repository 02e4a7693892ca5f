"""rollout.sglang_args: the sglang.launch_server arguments megarl reads (the attention backend, the expert
parallelism), those it sets itself (refused when given), and those that would place the weights otherwise than
megarl models them (refused where sharded delivery or checksum verification needs that placement). The config
checks, the resharder's generation layout (megarl.reshard.layout) and the server launch (megarl.rollout.
sglang_server) read the arguments here, the same way."""

from __future__ import annotations

from typing import Iterable

# The launch arguments megarl owns (where the server listens and on which GPUs, its share of memory, how weights
# reach it); extra arguments may override the rest, such as the attention backend or CUDA-graph batch sizes.
MANAGED_ARGS = ("--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--mem-fraction-static",
                "--skip-tokenizer-init", "--custom-weight-loader", "--enable-memory-saver",
                "--enable-deterministic-inference", "--dtype", "--enable-fp32-lm-head",
                "--enable-return-routed-experts", "--enable-lora", "--max-lora-rank", "--lora-target-modules",
                "--max-loras-per-batch")
# The attention backends sglang 0.5.17 runs deterministic inference with (its server_args refuses the others).
DETERMINISTIC_ATTENTION_BACKENDS = ("triton", "fa3", "flashinfer")
SGLANG_EP_FLAGS = ("--ep-size", "--expert-parallel-size", "--ep")  # sglang 0.5.17's names of its ep_size
# sglang 0.5.17 settings under which its ranks hold the weights otherwise than GenLayout (and megarl.rollout.
# weight_layout) place them: flag -> the values that keep the modelled placement (() for a switch: refused when given)
SGLANG_LAYOUT_FLAGS = {
    "--moe-a2a-backend": ("none",),  # DeepEP-class all-to-all: DeepEPMoE, shared experts at TP 1 or per-rank slots
    # FusedMoE's w13/w2 as loaded (auto: triton for a bf16 model on Hopper); triton_kernel transposes them,
    # flashinfer's runners pad and permute them after loading
    "--moe-runner-backend": ("auto", "triton"),
    "--ep-num-redundant-experts": ("0",),  # replicas of hot experts beside the contiguous EP blocks
    "--init-expert-location": ("trivial",),  # experts placed by a map instead of contiguous blocks
    "--enable-eplb": (),  # experts moved between ranks while serving
    "--moe-dp-size": ("1",), "--moe-data-parallel-size": ("1",),  # MoE TP = TP / (EP x MoE DP), other groups
    "--enable-dp-attention": (),  # attention TP = TP / DP: attention weights replicated across DP ranks
    "--dp-size": ("1",), "--data-parallel-size": ("1",),  # several TP groups in one server
    "--moe-dense-tp-size": (),  # the dense MLP layers at another TP
    "--enforce-shared-experts-fusion": (),  # the shared expert fused into the routed ones even at --ep-size > 1
    "--elastic-ep-backend": ("none",),  # EP ranks joining and leaving
    "--dwdp-size": ("1",),  # each rank prefetching every expert's weights
}
SGLANG_SWITCHES = ("--enable-eplb", "--enable-dp-attention", "--enforce-shared-experts-fusion",
                   "--disable-shared-experts-fusion")


def sglang_flags(extra_args) -> dict[str, str]:
    """{flag: value} of sglang.launch_server arguments ("--flag value", "--flag=value"; a switch maps to ""); the
    last of a repeated flag wins, as argparse does."""
    args, flags = [str(a) for a in extra_args], {}
    for k, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, equals, value = arg.partition("=")
        if not equals and flag not in SGLANG_SWITCHES and k + 1 < len(args) and not args[k + 1].startswith("--"):
            value = args[k + 1]
        flags[flag] = value
    return flags


def managed_args(extra_args: Iterable) -> list[str]:
    """Those of `extra_args` (as "--flag" or "--flag=value") that megarl sets itself."""
    return sorted(set(sglang_flags(extra_args)) & set(MANAGED_ARGS))


def attention_backend(extra_args: Iterable) -> str:
    """The attention backend a server launched with megarl's arguments and then `extra_args` uses."""
    return sglang_flags(extra_args).get("--attention-backend") or "triton"  # megarl's own choice unless overridden


def sglang_ep_size(extra_args: Iterable) -> int:
    """SGLang's expert parallelism under `extra_args`: the last --ep-size (or alias) given, 1 if none. A setting of
    SGLANG_LAYOUT_FLAGS (one that places the weights otherwise) is refused, naming it."""
    ep = 1
    for flag, value in sglang_flags(extra_args).items():
        if flag in SGLANG_EP_FLAGS:
            if not value.isdigit():
                raise ValueError(f"rollout.sglang_args: {flag} needs a number, got {value!r}")
            ep = int(value)
        elif flag in SGLANG_LAYOUT_FLAGS and value not in SGLANG_LAYOUT_FLAGS[flag]:
            raise ValueError(f"rollout.sglang_args: {flag}{' ' + value if value else ''} places SGLang's weights "
                             f"otherwise than megarl models them (sharded delivery and checksum verification need "
                             f"that layout; with rollout.weight_delivery=full, trainer.verify_weight_sync_deep or "
                             f"verify_weight_sync_every=0 it is free)")
    return ep

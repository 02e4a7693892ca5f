"""actor.fp32_lm_head: a bf16 model's output layer (the vocabulary projection) computed in float32.

The logits of a bf16 projection carry bf16's 8-bit mantissa: at a logit of ~20 that is a step of 0.125, which the
log-softmax passes on to every token's log-prob. SGLang's --enable-fp32-lm-head casts the hidden states and the
weight to float32 for this one matmul; so does a forward pre-hook here, on megatron's output layer, for the weight
it is given (the input embedding's when tied) or its own. The casts are differentiable, so the float32 weight
gradient is cast back into the bf16 parameter's. The output layer's fused weight-gradient accumulation
(gradient_accumulation_fusion, GPU) is turned off for this layer: it writes into the weight's main_grad, which the
float32 copy does not have. The log-prob kernel then reads float32 logits (twice the bytes of bf16 ones).
"""

from __future__ import annotations


def install(gpt) -> None:
    """Compute `gpt`'s output layer in float32 (a GPTModel of the last pipeline stage)."""
    layer = gpt.output_layer
    layer.gradient_accumulation_fusion = False

    def to_fp32(layer, args, kwargs):
        weight = kwargs.get("weight")
        kwargs["weight"] = (layer.weight if weight is None else weight).float()
        return (args[0].float(), *args[1:]), kwargs

    layer.register_forward_pre_hook(to_fp32, with_kwargs=True)

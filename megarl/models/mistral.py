"""Mistral (transformers' MistralForCausalLM: Mistral-7B, Mistral-Nemo, Mistral-Small): Llama's decoder, no biases,
plain RoPE (rope_theta from the config), head_dim given by the config where it is not hidden_size / heads
(Mistral-Nemo: 128 with hidden 5120 and 32 heads).

Sliding-window attention (`sliding_window`; Mistral-7B-v0.1's 4096; null from v0.2 on and in Nemo/Small) is not
implemented: megarl attends over the whole sequence, as SGLang's MistralForCausalLM (its Llama model) and
MixtralForCausalLM do, which is the sliding window's result exactly for sequences of at most sliding_window tokens.
megarl keeps every sequence within max_position_embeddings (a prompt's room is that minus the response budget:
megarl/data/inputs.py), so a window of at least max_position_embeddings is accepted and a shorter one refused,
naming both keys.
"""

from __future__ import annotations

from megarl.models.decoder import DecoderFamily


def check_sliding_window(hf: dict, name: str) -> None:
    window, positions = hf.get("sliding_window"), hf["max_position_embeddings"]
    if window is not None and window < positions:
        raise ValueError(
            f"{name} with sliding_window={window} < max_position_embeddings={positions} is not supported: megarl "
            f"(like SGLang) attends over the whole sequence, the window's result only for sequences of at most "
            f"{window} tokens. Set max_position_embeddings to at most {window} in config.json (megarl then keeps "
            f"prompt + response within it), or sliding_window to null for full attention")


class Mistral(DecoderFamily):
    name = "Mistral"
    architectures = ("MistralForCausalLM", "mistral")

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        check_sliding_window(hf, self.name)


FAMILY = Mistral()

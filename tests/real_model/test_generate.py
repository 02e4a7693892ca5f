"""The hf rollout engine's greedy responses on the real model are transformers' generate's, token for token."""

import torch

from megarl.data.inputs import load_tokenizer
from megarl.rollout.base import SamplingParams
from megarl.rollout.hf import HFRolloutEngine

QUESTIONS = ["What is 7 times 6?", "Answer with one word: what colour is the sky?"]  # the second ends in 16


def test_hf_engine_greedy_equals_transformers_generate(smollm2):
    tokenizer = load_tokenizer(str(smollm2.hf_dir))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True, return_dict=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    engine = HFRolloutEngine(str(smollm2.hf_dir))
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
    model = engine.model  # transformers' own model class, as loaded from the directory (float32)
    for prompt, generation in zip(prompts, sorted(generations, key=lambda g: g.prompt_index)):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        assert generation.token_ids == expected.tolist(), (tokenizer.decode(generation.token_ids), tokenizer.decode(expected))
        assert tokenizer.decode(generation.token_ids) == tokenizer.decode(expected)
    assert any(tokenizer.eos_token_id in g.token_ids for g in generations)  # a response ended at <|im_end|>

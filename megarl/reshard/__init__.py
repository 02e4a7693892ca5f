"""The policy's move from its training layout to its generation layout, and the planner that prices it.

inventory.py  the HF tensors of a model from its config.json, with how TP cuts each
layout.py     training (TP, PP, DP) and generation (TP) layouts over the same ranks
transfers.py  which rows move from which rank to which (the planner's bytes and the resharder's sends)
resharder.py  runs that plan over torch.distributed, bucket by bucket, from a megatron engine
memory.py     per-GPU memory of a training rank on paper (the planner's model; predict_peak)
plan.py       per-GPU memory and sync traffic on paper: python -m megarl.plan

It sits above engine/ (the resharder reads the engine's parameters) and below workers/.
"""

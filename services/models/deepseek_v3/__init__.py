"""The DeepSeek-V3 / Kimi-K2 target in torch, named as its checkpoint: config, model, MLA, MoE and its experts, the
training forward.
"""

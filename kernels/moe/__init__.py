"""The fused MoE: the router (gate and top-k), the token alignment, the grouped GEMM over experts, its tile tables
(tables/*.json) and configs, the expert weights' layouts and the torch reference. It may import gemm's INT4
unpack, the top of kernels/ (checks, shared memory, formats) and mla/latent_write.py's bf16 rounding.
"""

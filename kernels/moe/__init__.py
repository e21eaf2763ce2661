"""The fused MoE: the router (gate and top-k), the token alignment, the grouped GEMM over experts, its tile tables
(tables/*.json) and configs, the expert weights' layouts and the torch reference. It may import gemm's INT4
unpack and the top of kernels/.
"""

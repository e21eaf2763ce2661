"""The dense GEMMs of the step: bf16 with a fixed K split (row invariant), INT4 pack-quantized and FP8 block-
scaled, the INT4 unpack shared with the fused MoE, and their torch references. It imports the top of kernels/
(checks, shared memory, formats) and mla/latent_write.py's bf16 rounding.
"""

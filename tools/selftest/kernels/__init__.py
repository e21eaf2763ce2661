"""The kernel parts of the GPU self-test: each Triton kernel and decoder layer against its torch reference on the
device, and the MLA and MoE micro-benchmarks.
"""

"""The latent KV cache: the paged pool, its sizing, page tables, the prefix cache and prefix sharing, the CUDA-
graph memory pool and the memory checks. It imports the models and the config, never the step.
"""

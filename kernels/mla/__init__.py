"""The MLA attention kernels: the plan (which rows read which keys, in which splits), the split-KV attention, the
merge of its partials, the static (graph-shaped) plan, the latent-cache write, and the backend the model calls.
It imports the top of kernels/ (checks, shared memory, references), never moe or gemm.
"""

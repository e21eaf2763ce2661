"""A step's roofline on a named device from shapes alone: the device table, bytes / FLOPs / CTAs per launch, the
time model, and measured kernel times set against it on a GPU.
"""

"""Building blocks both models share: attention metadata and backends, linears (merged, packed), RMSNorm, RoPE, the
layer kernel switch.
"""

"""Checkpoints on disk: reading safetensors, loading into a model, random checkpoints, weight bytes per tensor and
the per-GPU memory plan.
"""

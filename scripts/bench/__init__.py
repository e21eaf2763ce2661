"""Benchmarks: A/B and speed runs on the demo, serving, tensor parallelism, kernels, grammar, CPU paths."""

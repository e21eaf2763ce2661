"""What one verify step asks of its device, counted where it runs: the step's batch and model, launches (aten ops
and Triton kernels), host syncs and collectives per layer, real TP ranks. The library behind `ddtree bench step`
and the selftest's step part.
"""

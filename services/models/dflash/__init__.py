"""The DFlash block-diffusion drafter: config, model, mask, checkpoint format, static-shape forward."""

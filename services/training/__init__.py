"""Training: the DFlash drafter trainer's pieces (tools/train_drafter.py drives them)."""

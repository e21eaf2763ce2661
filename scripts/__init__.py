"""The project's scripts, run from a checkout as `python -m scripts.FOLDER.NAME` (not installed):
data/ (corpus, demo pair, checkpoints, certificates, stubs), eval/ (model quality), bench/ (speed), dev/ (one-off
measurements). What a user runs on a GPU machine is a `ddtree` command instead: `ddtree selftest gpu`."""

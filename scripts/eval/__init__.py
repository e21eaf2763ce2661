"""Evaluations of the trained models: the drafter's acceptance and the target's loss and tasks."""

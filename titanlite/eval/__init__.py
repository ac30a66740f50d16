"""Evaluation: the validation loss and downstream tasks."""

"""Trainer: policy log-probabilities, optimizer and schedule, reference model, checkpoints."""

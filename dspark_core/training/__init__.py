"""Drafter training: the DSpark losses and the training loop against the frozen target."""

"""Training: the loss (`loss.py`), optimizer and schedule (`optim.py`), checkpoints, and the loop (`trainer.py`)."""

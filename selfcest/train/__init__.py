"""Training: turning scored clone trees into samples and micro-batches, and the trainer."""

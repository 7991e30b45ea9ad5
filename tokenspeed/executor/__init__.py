"""The executor: turns one scheduled step's logits into tokens (sampling) and, later, runs the model per step."""

"""The recipe: the typed training configuration and its sections."""

"""The built-in datasets, generated offline from a seed: formula-driven sets, digits, dSprites, counts."""

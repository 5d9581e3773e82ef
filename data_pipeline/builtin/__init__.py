"""Built-in datasets, generated offline from a seed."""

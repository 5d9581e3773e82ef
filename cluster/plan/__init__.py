"""The plan of a recipe on a profile (`planner`), part by part."""

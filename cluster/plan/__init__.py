"""The plan of a recipe on a profile: topology, batch split, compute, memory per device, data wait, storage."""

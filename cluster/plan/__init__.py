"""The plan of a recipe on a profile: topology, batch split, compute (`compute`; measured MFU: `mfu`), memory per
device, data wait, storage, and the evals' cost and cadence (`evals_cost`, `cadence`)."""

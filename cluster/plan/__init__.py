"""The plan of a recipe on a profile: topology, batch split, compute (measured MFU: `mfu`), memory per device, data
wait, storage."""

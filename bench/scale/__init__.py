"""ImageNet-21k scale without the images (`python -m bench.scale`)."""

"""Raw image collections to shards: readers (folders, ImageNet-21k tars, Parquet, TFDS), dedup, the writer."""

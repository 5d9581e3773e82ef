"""Raw image collections to shards: readers, dedup, the writer."""

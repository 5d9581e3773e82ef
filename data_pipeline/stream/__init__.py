"""Shards to batches: the order, shard reading, the streams, loader workers, augmentation."""

"""Shards to batches: the order, shard reading, the training and eval streams, loader workers, augmentation."""

"""The online stream: shards to batches."""

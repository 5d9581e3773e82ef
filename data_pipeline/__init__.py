"""vitscale data pipeline: raw images -> WebDataset shards + Parquet manifest -> deterministic, resumable streams.

Public API (see docs/interfaces.md): ``data_pipeline.stream.train_stream.TrainStream`` / ``StreamSpec``,
``data_pipeline.stream.eval_stream.EvalStream``, ``data_pipeline.stream.order.merge_stream_states``,
``data_pipeline.stream.augment.AugmentConfig``, ``data_pipeline.manifest.read_dataset_info``,
``data_pipeline.builtin.sets.ensure``; CLIs ``python -m data_pipeline.{write,validate,builtin}``.
Nothing is imported here so that ``import data_pipeline`` stays cheap (no torch in the writer's workers).
"""

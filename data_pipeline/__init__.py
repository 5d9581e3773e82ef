"""vitscale data pipeline: raw images -> WebDataset shards + Parquet manifest -> deterministic, resumable streams.

CLIs: ``python -m data_pipeline.{write,validate,builtin}``; the package map: docs/design.md, "Packages, what each
owns, and the import rules". Nothing is imported here, so ``import data_pipeline`` stays cheap.
"""

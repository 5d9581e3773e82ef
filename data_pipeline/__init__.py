"""vitscale data pipeline: raw images -> WebDataset shards + Parquet manifest -> deterministic, resumable streams.
Package map: docs/design.md, "Packages, what each owns, and the import rules".
"""

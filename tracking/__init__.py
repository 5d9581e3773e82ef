"""vitscale tracking: the run's record in MLflow.

``tracking.keys`` (metric and tag names), ``tracking.tracker`` (the rank-0, buffered, never-raising tracker),
``tracking.runs`` (run creation, the run's tags, final status) and the cross-run report (``python -m tracking.compare``,
``python -m tracking.ui``). Nothing is imported here so that ``import tracking.keys`` stays cheap.
"""

"""`make preflight` (`python -m cluster.preflight`): a cluster's nodes measured against the plan before the paid run
(docs/preflight.md). `node` runs on each node, `collective` across the ranks, `checks` judges, `replan` re-plans."""

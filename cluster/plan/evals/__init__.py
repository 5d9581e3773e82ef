"""The evals in the plan: each suite's cadence, price and split sizes (docs/vtab.md, "Eval cost in the plan")."""

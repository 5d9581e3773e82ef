"""The evals in the plan: each suite's cadence (`cadence`, also the driver's rule), its price (`cost`) and the split
sizes it is priced with (`splits`; docs/vtab.md, "Eval cost in the plan")."""

"""`make preflight`: a cluster's nodes measured against the plan before the paid run (docs/preflight.md)."""

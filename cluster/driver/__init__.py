"""The Ray job: the driver (`python -m cluster.driver`), its watchdog, evals after each checkpoint, records."""

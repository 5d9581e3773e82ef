"""The Ray job: the driver, its watchdog, evals after each checkpoint, records."""

"""vitscale tracking: the run's record in MLflow. Nothing is imported here, so ``import tracking.keys`` stays cheap."""

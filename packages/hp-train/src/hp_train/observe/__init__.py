"""What a run shows: metrics, logs, plots, TensorBoard, progress, the monitor and non-finite
stops."""

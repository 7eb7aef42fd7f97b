"""What the server is doing, for /metrics, the logs and the web console: telemetry, each run's metric
history, long work in progress, and the console's read views. No tensors, no HTTP.
"""

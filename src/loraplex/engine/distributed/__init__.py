"""Data-parallel engine ranks: rank 0 serves the runtime and keeps every rank's replica in step.

`coordinator.DistributedEngine` (rank 0) splits each pass across ranks by tokens and does one flat
gradient all-reduce per optimizer step; `worker` runs ranks ≥ 1; `launch` starts ranks on this machine.
Engine code: no HTTP, no SQL.
"""

"""Control plane: ordered per-run command queues, scheduler, futures, sessions, persistence.

No tensors: the runtime hands the engine numpy arrays and plain dataclasses.
"""

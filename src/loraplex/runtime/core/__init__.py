"""The engine-facing core: commands, per-run queues, the scheduler, the executor and the engine loop.

What it knows: runs, their seq_id-ordered commands, slots and what the engine is doing. What it must not
know: SQL, HTTP, or how an outcome is stored (it hands each engine call's outcome on, see engine_loop.py).
"""

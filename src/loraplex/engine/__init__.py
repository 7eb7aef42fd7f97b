"""Compute plane, the only owner of torch state: slots, fused passes, losses, optimizer, checkpoints, sampler.

No HTTP, no SQL.
"""

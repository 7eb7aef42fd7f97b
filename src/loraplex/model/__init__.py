"""Decoder definitions, multi-LoRA linear layers, HF checkpoint loading, the built-in tiny model.

Knows nothing of HTTP, SQL, runs or tenants.
"""

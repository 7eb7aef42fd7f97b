"""The Tinker API under /api/v1: its routes (one module per family), wire models and protobuf codecs, and
the submission thread that carries training requests to the runtime. No tensors, no SQL.
"""

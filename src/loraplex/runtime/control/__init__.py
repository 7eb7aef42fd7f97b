"""The control plane: submissions, sessions, the catalog of runs, checkpoints and samplers, API keys,
futures, retention, and the store they persist in (store/: SQLAlchemy, SQLite or PostgreSQL). No tensors.
"""

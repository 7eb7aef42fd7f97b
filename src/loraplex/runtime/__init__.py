"""The runtime: everything between the API and the engine, in four rooms.

- `core/`: the engine-facing core. Commands, run queues, the scheduler, the executor and the engine loop:
  the one thread that calls the engine. No SQL.
- `control/`: the control plane. Submissions, sessions, the catalog, keys, futures, retention and the
  store (SQLAlchemy).
- `serving/`: inference for the OpenAI-compatible endpoints: model names, completions, chat templates,
  the text codec.
- `observability/`: telemetry, metric history, work in progress and the web console's data.

No tensors anywhere: the runtime hands the engine numpy arrays and plain dataclasses.
"""

"""The OpenAI-compatible API under /v1: models, aliases, completions and chat completions of adapters."""

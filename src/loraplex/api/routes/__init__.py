"""Route modules, one per verb family of the Tinker protocol. Handlers read, validate, submit, answer."""

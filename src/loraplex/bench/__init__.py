"""`loraplex bench`: the measurements behind our published performance figures (docs/BENCHMARKS.md).

Each subcommand times the engine against the baseline a user would pick instead, interleaved in one
process, and prints rows plus a summary (JSON lines with --json). Not a test: nothing here asserts timings.
"""

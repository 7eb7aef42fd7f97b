"""The sampler: KV-cache generation from the base model and immutable snapshots, continuously batched.

`generation.Sampler` drives it; `sampling` draws tokens, `stops` decides when a sequence ends,
`prompt_scores` scores prompts, `snapshot_cache` keeps snapshots on the device, `validation` checks
requests. Engine code: no HTTP, no SQL.
"""

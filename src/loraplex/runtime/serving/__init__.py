"""Inference for the OpenAI-compatible endpoints over the Tinker sampler: model names and aliases,
completions, chat templates and the text codec. No tensors, no HTTP.
"""

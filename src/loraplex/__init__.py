"""loraplex: many LoRA fine-tunes trained at once on one frozen base model, behind the Tinker API."""

__version__ = "0.1.0"

"""Multi-LoRA: adapters served per request on one base model."""

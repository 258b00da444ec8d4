"""Multi-LoRA: PEFT adapters served on one base model, each request's rows with their own adapter (or none)."""

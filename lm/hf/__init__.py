"""Hugging Face transformers: our models and tokenizers as its checkpoints, mapped exactly or refused."""

"""Sizes from a config alone, before anything is built: parameter counts, FLOPs per token, per-device memory."""

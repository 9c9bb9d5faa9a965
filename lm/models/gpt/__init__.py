"""The decoder-only family (model.arch gpt): config.py (its keys), model.py (the GPT), hf.py (transformers
classes), family.py (its spec, `FAMILY`). Importing this package imports none of them, so reading a config
needs no torch."""

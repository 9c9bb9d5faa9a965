"""The encoder-decoder (model.arch encdec): config.py (its keys), model.py (the transformer of "Attention Is
All You Need"), sampling.py (filling masks), family.py (its spec, `FAMILY`). Importing this package
imports none of them."""

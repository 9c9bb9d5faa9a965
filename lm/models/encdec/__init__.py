"""The encoder-decoder (model.arch encdec): config.py (its keys), model.py (the transformer of "Attention Is
All You Need"), sampling.py (filling masks), family.py (its spec, `EncDecFamily`). Importing this package
imports none of them."""

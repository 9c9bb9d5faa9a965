"""The encoder alone (model.arch encoder): config.py (its keys), model.py (the bidirectional trunk and its
heads), hf.py (BERT), family.py (its spec, `FAMILY`). Importing this package imports none of them."""

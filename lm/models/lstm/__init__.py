"""The recurrent baseline (model.arch lstm): config.py (its keys), model.py (the LSTM language model),
family.py (its spec, `FAMILY`). Importing this package imports none of them."""

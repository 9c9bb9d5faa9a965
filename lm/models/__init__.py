"""The model families, one folder each (`gpt/`, `encdec/`, `encoder/`, `lstm/`: its config, its model, its
spec), the spec every family fills in (`family.py`), the registry that finds one by model.arch (`registry.py`),
and the layers, losses, sizes and sampling loops the families share.

Import from the submodules: this file stays empty so that reading a config does not import torch.

`lm.export` writes the shared layers (`block` and the modules it imports: `attention`, `layers`, `kv_cache`) into
exports as code, to run where lm is not installed (`lm.hf.remote_code`): they import torch, each other and the
`TransformerConfig` of `config` (for which the export writes a stand-in) only.
"""

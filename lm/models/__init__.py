"""Model code: imports only torch and this package.

Import from the submodules (`lm.models.gpt`, `lm.models.config`, ...): this file stays empty so that
reading a config does not import torch.
"""

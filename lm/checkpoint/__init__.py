"""Checkpoints: the store of a run's checkpoint directories (store.py, manifest.py), the policy that resumes
a run from one (resume.py), the consolidated safetensors format (consolidated.py), and reading a
checkpoint's weights on one process (weights.py, loading.py)."""

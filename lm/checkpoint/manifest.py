"""A checkpoint's manifest.json: the size and sha256 of every file (state.json included), written last
and checked before use.

A checkpoint without one (written before manifests existed, or with it deleted) cannot be checked: resume
refuses it unless checkpoint.allow_unverified is set, and the tools that read weights warn.
"""

import json
import logging
from pathlib import Path

from lm.errors import CheckpointError
from lm.io import sha256_file

log = logging.getLogger("lm.checkpoint")

MANIFEST = "manifest.json"


def write_manifest(step_dir: Path) -> None:
    """Record the size and sha256 of every file under `step_dir` (relative POSIX paths)."""
    files = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(step_dir).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify_checkpoint(step_dir: Path, require_manifest: bool = True) -> None:
    """Check every file of a complete checkpoint against its manifest: all sizes first (cheap), then all
    sha256 sums. Raises CheckpointError naming the first bad file; files not in the manifest are ignored.
    Without a manifest: CheckpointError, or with `require_manifest=False` a warning."""
    try:
        json.loads((step_dir / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}/state.json: missing (an incomplete checkpoint)") from None
    except ValueError:
        raise CheckpointError(f"{step_dir}/state.json: not valid JSON (corrupt)") from None
    if not (step_dir / MANIFEST).is_file():
        if require_manifest:
            raise CheckpointError(f"{step_dir}: no {MANIFEST}, so its files cannot be checked (written before "
                                  "checkpoints had one, or it was deleted); set checkpoint.allow_unverified=true "
                                  "to resume from it unchecked")
        log.warning("%s: no %s; its files are read unchecked", step_dir, MANIFEST)
        return
    try:
        files = {rel: (int(e["size"]), str(e["sha256"]))
                 for rel, e in json.loads((step_dir / MANIFEST).read_text())["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{step_dir}/{MANIFEST}: unreadable (corrupt)") from None
    for rel, (size, _) in files.items():
        path = step_dir / rel
        if not path.is_file():
            raise CheckpointError(f"{step_dir}/{rel}: missing")
        actual = path.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            raise CheckpointError(f"{step_dir}/{rel}: {actual:,} bytes, manifest says {size:,} ({what})")
    for rel, (_, sha256) in files.items():
        if sha256_file(step_dir / rel) != sha256:
            raise CheckpointError(f"{step_dir}/{rel}: sha256 differs from the manifest (corrupt)")

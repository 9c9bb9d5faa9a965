"""Sharded checkpoints through torch.distributed.checkpoint (DCP).

Layout of a run directory:

    <out_dir>/config.yaml                  resolved config of the run
    <out_dir>/checkpoints/step_00000300/   one complete checkpoint
        .metadata, __<rank>_0.distcp       ddp, fsdp: DCP model and optimizer, each rank its own shard
        deepspeed/, latest                 deepspeed: the engine's own checkpoint (tag "deepspeed")
        rng_rank<r>.pt                     each rank's RNG states
        config.yaml                        the config that wrote it
        manifest.json                      size and sha256 of every file above
        state.json                         step, loader position, tokens seen, world size, engine

ddp and fsdp write the same DCP format, so either resumes the other's checkpoints at any world size.

A checkpoint is written under `step_XXXXXXXX.tmp`; rank 0 writes manifest.json and then state.json only
after every rank has finished, and renames the directory into place last, so a directory without a
suffix and with a state.json is always complete. A kill at any moment of a save leaves the previous
checkpoints as they were: a same-step checkpoint being replaced waits under `.replaced` (restored by
`latest_valid_checkpoint` if the kill came between the two renames), and an old checkpoint is renamed
to `.deleting` before it is deleted, so a half-deleted one never looks complete. Checkpoints written
before manifest.json existed are accepted without verification.
"""

import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lm.config import ConfigError, JobConfig, load_config, save_config
from lm.distributed.env import DistEnv
from lm.hashing import sha256_file

log = logging.getLogger(__name__)

ARCH_NAMES = {"gpt": "a decoder-only GPT", "encdec": "an encoder-decoder", "lstm": "an LSTM"}
DEEPSPEED_TAG = "deepspeed"
"""Subdirectory (DeepSpeed's checkpoint tag) of a step directory holding a DeepSpeed engine's files."""
UNIVERSAL_TAG = "deepspeed_universal"
"""Its conversion to DeepSpeed's universal format, made when a run resumes at another world size or stage."""

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_\d{8}\.(tmp|deleting|replaced)$")


# DCP warns on every single-process save and load (eval, sample, a run without torchrun); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the path."""


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run directory, its checkpoints/ directory or one step directory; return the step dir."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    for root in (path, checkpoint_root(path)):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(
        f"{path}: no complete checkpoint (expected a step_XXXXXXXX directory with state.json, "
        f"or a run directory containing checkpoints/)"
    )


def read_state(path: Path) -> dict:
    """state.json; checkpoints from before the engine switch were written by ddp."""
    return {"engine": "ddp", **json.loads((path / "state.json").read_text())}


def check_engine(path: Path, cfg: JobConfig, world_size: int) -> bool:
    """Refuse a checkpoint another engine family wrote; True when a DeepSpeed checkpoint must first be
    converted to DeepSpeed's universal format (another world size or ZeRO stage)."""
    state = read_state(path)
    saved, wanted = state["engine"], cfg.parallel.engine
    if (saved == "deepspeed") != (wanted == "deepspeed"):
        raise CheckpointError(
            f"{path}: written by the {saved} engine, and parallel.engine is {wanted}; engines other than "
            f"ddp/fsdp cannot read each other's checkpoints. Consolidate it (python -m lm.consolidate "
            f"--checkpoint {path} OUT.safetensors) and start a new run from its weights with "
            f"checkpoint.init_from=OUT.safetensors, or resume with parallel.engine={saved}"
        )
    return saved == "deepspeed" and (state["world_size"] != world_size or state.get("zero_stage") != cfg.parallel.zero_stage)


def read_config(path: Path) -> JobConfig:
    """The config a checkpoint was written with, validated like any other config."""
    return load_config(path / "config.yaml")


def save_checkpoint(root: Path, step: int, engine, state: dict, cfg: JobConfig, env: DistEnv, keep: int) -> Path:
    """Collectively write one checkpoint; every rank must call this. Returns the final directory.

    Retention then keeps `keep` complete checkpoints, always including this one."""
    final = root / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(root)
        tmp.mkdir()
    env.barrier()
    engine.save(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    torch.save(rng, tmp / f"rng_rank{env.rank}.pt")
    env.barrier()
    if env.is_main:
        save_config(cfg, tmp / "config.yaml")
        _write_manifest(tmp)
        meta = {"world_size": env.world_size, "engine": cfg.parallel.engine}
        if cfg.parallel.engine == "deepspeed":
            meta["zero_stage"] = cfg.parallel.zero_stage
        (tmp / "state.json").write_text(json.dumps({**state, **meta}, indent=2))
        _publish(tmp, final)
        _prune(root, final, keep)
        log.info("saved checkpoint %s", final)
    env.barrier()
    return final


def _write_manifest(step_dir: Path) -> None:
    """Record the size and sha256 of every file under `step_dir` (relative POSIX paths)."""
    files = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(step_dir).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint into place. A checkpoint of the same step (a run that resumed from an
    earlier one) is moved aside first and deleted only once the new one is in place."""
    if not final.exists():
        tmp.rename(final)
        return
    aside = final.with_name(final.name + ".replaced")
    final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside)


def _remove(path: Path) -> None:
    """Delete a checkpoint; renamed first, so a kill half-way never leaves a dir that looks complete."""
    doomed = path.with_name(path.name + ".deleting")
    path.rename(doomed)
    shutil.rmtree(doomed)


def _step(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _prune(root: Path, final: Path, keep: int) -> None:
    """Keep `keep` complete checkpoints: `final`, just written, always; then the newest below its step;
    steps above it come last, as they belong to a run that resumed from an earlier checkpoint."""
    others = [p for p in complete_checkpoints(root) if p != final]
    below = [p for p in others if _step(p) < _step(final)]
    above = [p for p in others if _step(p) > _step(final)]
    ranked = [final, *reversed(below), *reversed(above)]
    for old in ranked[keep:]:
        _remove(old)


def _restore_replaced(root: Path) -> None:
    """A kill between the two renames of `_publish` leaves the replaced checkpoint only under `.replaced`."""
    for aside in root.glob("step_*.replaced"):
        final = aside.with_suffix("")
        if not final.exists():
            log.warning("%s: a save was killed while replacing this checkpoint; restoring it", final)
            aside.rename(final)


def _clean_leftovers(root: Path) -> None:
    """Remove what killed saves left (`.tmp`, `.deleting`, `.replaced` dirs); none is a complete checkpoint
    once `.replaced` ones without a successor are restored."""
    _restore_replaced(root)
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path)


def verify_checkpoint(step_dir: Path) -> None:
    """Check every file of a complete checkpoint against its manifest: all sizes first (cheap), then all
    sha256 sums. Raises CheckpointError naming the first bad file; files not in the manifest are ignored."""
    try:
        json.loads((step_dir / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}/state.json: missing (an incomplete checkpoint)") from None
    except ValueError:
        raise CheckpointError(f"{step_dir}/state.json: not valid JSON (corrupt)") from None
    if not (step_dir / MANIFEST).is_file():
        log.debug("%s: no %s (written before checkpoints had one); not verified", step_dir, MANIFEST)
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


def latest_valid_checkpoint(root: Path, env: DistEnv | None = None) -> Path | None:
    """The newest complete checkpoint under `root` that verifies, or None when there is none at all.

    Each one skipped is logged with the reason; raises CheckpointError listing them when checkpoints
    exist but none verifies. With `env`, every rank must call this: rank 0 verifies and broadcasts its
    choice, so all ranks resume from the same checkpoint.
    """
    choice, error = None, None
    if env is None or env.is_main:
        if root.is_dir():
            _restore_replaced(root)
        found = complete_checkpoints(root)
        problems = []
        for path in reversed(found):
            try:
                verify_checkpoint(path)
            except CheckpointError as err:
                log.warning("skipping checkpoint %s: %s", path, err)
                problems.append(str(err))
                continue
            choice = path
            break
        if found and choice is None:
            error = f"no usable checkpoint in {root}: " + "; ".join(problems)
    if env is not None:
        choice, error = env.broadcast_object((choice, error))
    if error is not None:
        raise CheckpointError(error)
    return choice


def ensure_universal(path: Path, env: DistEnv) -> None:
    """Give a DeepSpeed checkpoint a universal twin (`deepspeed_universal/`), which loads at any world
    size and ZeRO stage; rank 0 converts once, into a temporary directory renamed when complete."""
    from lm.distributed.zero import convert_to_universal

    if env.is_main and not (path / UNIVERSAL_TAG).is_dir():
        log.info("%s: converting the DeepSpeed checkpoint to a universal one for another world size or stage", path)
        tmp_tag = UNIVERSAL_TAG + ".tmp"
        shutil.rmtree(path / tmp_tag, ignore_errors=True)
        convert_to_universal(path, DEEPSPEED_TAG, tmp_tag)
        (path / tmp_tag).rename(path / UNIVERSAL_TAG)
    env.barrier()


def load_checkpoint(path: Path, engine, env: DistEnv) -> dict:
    """Load model and optimizer through the engine (resharded to this world size) and this rank's RNG;
    return state.json."""
    state = read_state(path)
    engine.load(path, state)
    rng_file = path / f"rng_rank{env.rank}.pt"
    if state["world_size"] == env.world_size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], env.device)
    else:
        log.warning("world size changed (%d -> %d): RNG states start fresh", state["world_size"], env.world_size)
    return state


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint saved at any world size, on one process."""
    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    model.load_state_dict(model_sd)


def check_compatible(path: Path, cfg: JobConfig) -> None:
    """Refuse to resume a checkpoint whose architecture or model shape differs from the current config.

    Keys missing from an older checkpoint's config take their defaults, as they did when it was written.
    """
    saved = read_config(path).to_dict()["model"]
    current = cfg.to_dict()["model"]
    if saved["arch"] != current["arch"]:
        raise ConfigError(f"{path}: checkpoint is {ARCH_NAMES[saved['arch']]} (model.arch={saved['arch']}) "
                          f"but the config asks for {ARCH_NAMES[current['arch']]} (model.arch={current['arch']}); "
                          "use another train.out_dir to start a new run")
    diff = sorted(k for k in current if saved[k] != current[k] and k != "dropout")
    if diff:
        details = ", ".join(f"model.{k}: {saved[k]!r} -> {current[k]!r}" for k in diff)
        raise ConfigError(f"{path}: checkpoint has a different model shape ({details}); "
                          "use another train.out_dir to start a new run")


def data_identity(manifest: dict) -> dict:
    """What state.json records of the prepared data a run trains on; `content_hash` fingerprints the
    input files, tokenizer, split and shard size, so it changes whenever the shards' bytes would."""
    return {"content_hash": manifest["content_hash"], "source": manifest["source"],
            "train_tokens": manifest["splits"]["train"]["tokens"]}


def check_data(path: Path, manifest: dict, cfg: JobConfig) -> None:
    """Refuse to resume on data other than the checkpoint's unless checkpoint.allow_data_change is set.
    Checkpoints from before state.json recorded its data are not checked."""
    saved = read_state(path).get("data")
    current = data_identity(manifest)
    if saved is None or saved["content_hash"] == current["content_hash"]:
        return
    what = (f"{path} trained on {saved['source']!r} ({saved['train_tokens']:,} train tokens, content hash "
            f"{saved['content_hash'][:12]}), but data.dir={cfg.data.dir!r} now holds {current['source']!r} "
            f"({current['train_tokens']:,} train tokens, content hash {current['content_hash'][:12]})")
    if not cfg.checkpoint.allow_data_change:
        raise CheckpointError(f"{what}. Prepare the original data again, point data.dir at it, or set "
                              "checkpoint.allow_data_change=true to go on with the new data")
    log.warning("%s; going on with the new data (checkpoint.allow_data_change=true)", what)


def check_init_from(path: Path, cfg: JobConfig) -> None:
    """Refuse a consolidated file (checkpoint.init_from) whose model differs from the config's."""
    from lm.consolidate import read_consolidated_config

    saved = read_consolidated_config(path).to_dict()["model"]
    current = cfg.to_dict()["model"]
    diff = sorted(k for k in current if saved[k] != current[k] and k != "dropout")
    if diff:
        details = ", ".join(f"model.{k}: {saved[k]!r} -> {current[k]!r}" for k in diff)
        raise ConfigError(f"checkpoint.init_from: {path} holds a different model ({details})")


def load_for_inference(path: str | Path, device: torch.device) -> tuple[nn.Module, JobConfig, Path]:
    """Build the model a checkpoint describes and load its weights; returns (model, config, source).

    `path`: a run directory, its checkpoints/ or one step directory of any engine (DeepSpeed's are
    merged by zero_to_fp32), or a consolidated .safetensors file. A step directory is verified against
    its manifest first: a damaged one raises CheckpointError naming the file.
    """
    from lm.consolidate import load_checkpoint_weights, load_consolidated
    from lm.models.factory import build_model

    path = Path(path)
    if path.suffix == ".safetensors":
        model, cfg = load_consolidated(path, device)
        return model, cfg, path
    step_dir = resolve_checkpoint(path)
    verify_checkpoint(step_dir)
    cfg = read_config(step_dir)
    model = build_model(cfg.model)
    load_checkpoint_weights(step_dir, model)
    return model.to(device).eval(), cfg, step_dir

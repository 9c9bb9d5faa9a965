"""Importing a Hugging Face checkpoint on this machine: wall time and peak memory of `load_hf_model`, each in
a fresh process, for random checkpoints of real shapes written here (no download).

The checkpoint is written shard by shard, each tensor drawn just before its shard is saved, so writing a
1B-parameter model needs the memory of one shard, not of the model.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lm.hf.targets import pick_target
from lm.models.gpt.config import GPTConfig
from lm.models.registry import family_of

MODELS = {
    # GPT-2 small (our defaults), stored in float32 as openai-community/gpt2 is
    "gpt2-124m": (GPTConfig(), torch.float32),
    # TinyLlama-1.1B's shape: 22 layers of width 2048, 32 query heads sharing 4 key/value heads; bfloat16 as
    # it is published
    "llama-1.1b": (GPTConfig(vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_kv_head=4, d_model=2048,
                               d_ff=5632, bias=False, pos="rope", norm="rmsnorm", norm_eps=1e-5, mlp="swiglu",
                               tie_embeddings=False), torch.bfloat16),
}
SHARD_BYTES = 2 * 10**9  # save_pretrained's default max_shard_size is 5 GB; smaller shows the index at work

# Run in a fresh interpreter: the peak resident set is the import's, not this process's. Prints JSON.
_CHILD = """
import json, sys, time
import torch
from lm.bench.common import peak_memory_gib, reset_peak_memory
from lm.checkpoint.loading import load_hf_model
from lm.models.hf_checkpoint import read_hf_model
if sys.argv[2] == "transformers":
    from transformers import AutoModelForCausalLM
cpu = torch.device("cpu")
base = peak_memory_gib(cpu)
reset_peak_memory(cpu)
start = time.perf_counter()
if sys.argv[2] == "ours":
    model = load_hf_model(read_hf_model(sys.argv[1]))
else:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
loaded = time.perf_counter()
with torch.no_grad():  # touches every weight: a loader that maps the file lazily pays for it here
    if sys.argv[2] == "ours":
        model.logits(model(torch.zeros(1, 8, dtype=torch.long)))
    else:
        model(torch.zeros(1, 8, dtype=torch.long))
done = time.perf_counter()
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"load s": loaded - start, "forward s": done - loaded, "peak GiB": peak_memory_gib(cpu),
                  "base GiB": base, "params": params}))
"""


def write_random_checkpoint(cfg: GPTConfig, directory: Path, dtype: torch.dtype, shard_bytes: int) -> int:
    """A transformers checkpoint of `cfg` with N(0, 0.02) weights (unit gains), in shards of about
    `shard_bytes`; returns the bytes of weights written."""
    family = family_of(cfg)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in family.build(cfg).named_parameters()}
    target = pick_target(cfg, family.hf.targets, cfg.title)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(target.config(cfg, None, dtype), indent=2))
    tensors: dict[str, tuple[int, ...]] = {}  # a fused tensor (GPT-2's c_attn holds q, k and v) is written once
    for ours, parts in target.plan(cfg).items():
        rest = tuple(shapes[ours][1:])
        for part in parts:
            tensors[part.name] = part.stored_shape(rest)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {name: (torch.ones(shape) if len(shape) == 1 and "bias" not in name
                      else torch.randn(shape, generator=generator) * 0.02).to(dtype) for name, shape in shard}
        save_file(out, directory / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(out, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def measure_import(directory: Path, who: str) -> dict:
    """Time and peak memory of importing `directory` in a fresh process: `who` is "ours" (`load_hf_model`) or
    "transformers" (`from_pretrained` in float32)."""
    result = subprocess.run([sys.executable, "-c", _CHILD, str(directory), who], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])

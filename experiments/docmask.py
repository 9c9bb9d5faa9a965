"""Document-masked attention: what the boolean document mask costs against the is_causal path, in the whole
model and in attention alone, and flex_attention with a document block mask beside them (same outputs?).

    python -m experiments.docmask [--device cuda] [--warmup 2] [--reps 5] [--no-compile]

Two tables: the demo model's forward and backward with and without packed positions, and attention alone.
"""

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from lm.bench.common import WARMUP, fmt, median_seconds, median_seconds_interleaved, preset_config, print_table
from lm.cli import positive_int, run
from lm.config import JobConfig
from lm.distributed.env import init_device
from lm.distributed.precision import autocast_for, use_bf16
from lm.models.attention import attend, document_causal_mask
from lm.models.gpt.model import GPT
from lm.models.registry import get_family

SHAPES = [(4, 128), (2, 1024)]
"""(batch, seq_len) of the rows: the demo's training window, and a long one at a small batch"""


def packed_positions(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(B, T) positions of windows packed from documents of random lengths, 1 to seq_len // 2 tokens (about
    4 a window), each row with its own boundaries; a row's last document is cut at the window's end."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = torch.randint(1, seq_len // 2 + 1, (seq_len,), generator=generator)  # more than enough
        rows.append(torch.cat([torch.arange(n) for n in lengths.tolist()])[:seq_len])
    return torch.stack(rows)


def bench_model_paths(cfg: JobConfig, device: torch.device, batch: int, seq_len: int, warmup: int,
                      reps: int) -> dict:
    """ms of one forward + backward of the model (the trainer's precision) without positions (SDPA is_causal)
    and with packed positions (SDPA with the boolean document mask), timed in turns."""
    torch.manual_seed(0)
    model = GPT(replace(cfg.model, block_size=max(cfg.model.block_size, seq_len), dropout=0.0)).to(device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=generator).to(device)
    inputs, targets = x[:, :-1], x[:, 1:]
    positions = packed_positions(batch, seq_len).to(device)
    autocast = autocast_for(cfg.train.dtype, device)

    def step(pos: torch.Tensor | None) -> None:
        batch = [inputs, targets] if pos is None else [inputs, targets, pos]
        with autocast:
            loss = get_family("gpt").training.loss(model, model, batch).optimized
        loss.backward()
        model.zero_grad(set_to_none=True)

    times = median_seconds_interleaved({"is_causal": lambda: step(None), "mask": lambda: step(positions)},
                                       device, warmup, {"is_causal": reps, "mask": reps})
    return {name: seconds * 1e3 for name, seconds in times.items()}


def document_block_mask(positions: torch.Tensor):
    """flex_attention's BlockMask of `document_causal_mask(positions)`: key j visible to query i when j <= i
    in the same document; positions (B, T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = positions.shape
    doc = (positions == 0).cumsum(dim=-1)  # (B, T)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(same_document_causal, B, None, T, T, device=positions.device)


def flex_document_attention(block_mask) -> Callable[..., torch.Tensor]:
    """flex_attention with `block_mask`, compiled (eager flex_attention is a slow reference, not a kernel): a
    function of q (B, nh, T, hs), k, v (B, nkv, T, hs) -> (B, T, nh * hs), like `attend`."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = q.shape
        y = flex(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != nh)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(B, T, nh * hs)

    return run


def _attention_inputs(cfg: JobConfig, batch: int, seq_len: int, device: torch.device,
                      dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    m = cfg.model
    shapes = [(batch, m.n_head, seq_len, m.head_dim)] + 2 * [(batch, m.kv_heads, seq_len, m.head_dim)]
    return [torch.randn(s, generator=generator).to(device, dtype).requires_grad_() for s in shapes]


def bench_attention(cfg: JobConfig, device: torch.device, batch: int, seq_len: int, warmup: int, reps: int,
                    flex: bool = True) -> dict:
    """Attention alone at the model's head shapes (bf16 where the trainer uses it, else fp32): SDPA is_causal,
    SDPA with the boolean document mask and, with `flex`, compiled flex_attention with the document block
    mask, each timed in turns for the forward ("forward", ms) and the forward + backward ("forward +
    backward", ms; flex_attention not on a CPU, where torch has no backward for it); the time to build each
    mask (ms); and the largest difference between flex_attention's and SDPA's outputs (and q gradients
    where flex has a backward), in fp32."""
    positions = packed_positions(batch, seq_len).to(device)
    mask = document_causal_mask(positions)  # (B, 1, T, T)
    dtype = torch.bfloat16 if use_bf16(cfg.train.dtype, device.type) else torch.float32
    q, k, v = _attention_inputs(cfg, batch, seq_len, device, dtype)
    fns = {"is_causal": lambda q, k, v: attend(q, k, v, is_causal=True),
           "mask": lambda q, k, v: attend(q, k, v, mask=mask)}
    row: dict = {"mask build": median_seconds(lambda: document_causal_mask(positions), device, warmup, reps) * 1e3}
    flex_backward = device.type != "cpu"
    if flex:
        fns["flex"] = flex_document_attention(document_block_mask(positions))
        row["block mask build"] = median_seconds(lambda: document_block_mask(positions), device, warmup, reps) * 1e3
        row["max |flex - mask|"] = _max_difference(fns["flex"], fns["mask"], cfg, batch, seq_len, device,
                                                   flex_backward)

    inference = [t.detach() for t in (q, k, v)]  # flex_attention on a CPU refuses inputs that require grad

    def forward(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            fn(*inference)
        return run

    def forward_backward(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            fn(q, k, v).sum().backward()
            q.grad = k.grad = v.grad = None
        return run

    with_backward = {name: fn for name, fn in fns.items() if name != "flex" or flex_backward}
    for what, fn_set, wrap in (("forward", fns, forward), ("forward + backward", with_backward, forward_backward)):
        times = median_seconds_interleaved({name: wrap(fn) for name, fn in fn_set.items()}, device, warmup,
                                           dict.fromkeys(fn_set, reps))
        row[what] = {name: seconds * 1e3 for name, seconds in times.items()}
    return row


def _max_difference(fn: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], cfg: JobConfig,
                    batch: int, seq_len: int, device: torch.device, backward: bool) -> float:
    """Largest |difference| of the outputs (and with `backward` of q's gradient) of two attention functions,
    in fp32."""
    found = []
    for attention in (fn, reference):
        q, k, v = _attention_inputs(cfg, batch, seq_len, device, torch.float32)
        if not backward:
            q, k, v = q.detach(), k.detach(), v.detach()
        y = attention(q, k, v)
        if backward:
            y.square().sum().backward()
        found.append((y.detach(), q.grad if backward else torch.zeros(())))
    (y, grad), (y_ref, grad_ref) = found
    return max((y - y_ref).abs().max().item(), (grad - grad_ref).abs().max().item())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.docmask", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--warmup", type=WARMUP, default=2, help="untimed repetitions first")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed repetitions (the median is reported)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip flex_attention")
    args = parser.parse_args(argv)
    device = init_device(args.device, "--device")
    cfg, _ = preset_config("demo", device)
    model_rows, attention_rows = [], []
    for batch, seq_len in SHAPES:
        shape = f"{batch} x {seq_len}"
        ms = bench_model_paths(cfg, device, batch, seq_len, args.warmup, args.reps)
        model_rows.append([shape, f"{ms['is_causal']:.1f}", f"{ms['mask']:.1f}", f"{ms['mask'] / ms['is_causal']:.2f}"])
        row = bench_attention(cfg, device, batch, seq_len, args.warmup, args.reps, flex=args.compile)
        for what in ("forward", "forward + backward"):
            ms = row[what]
            attention_rows.append([shape, what, f"{ms['is_causal']:.2f}", f"{ms['mask']:.2f}",
                                   fmt(ms.get("flex"), ".2f"), f"{row['mask build']:.2f}",
                                   fmt(row.get("block mask build"), ".2f"), fmt(row.get("max |flex - mask|"), ".1e")])
    print_table("docmask: demo model forward + backward (ms), SDPA is_causal vs the boolean document mask; "
                "documents of 1 to T/2 tokens", ["batch x seq", "is_causal", "document mask", "mask / is_causal"],
                model_rows)
    print_table(f"docmask: attention alone (ms), {cfg.model.n_head} heads x {cfg.model.head_dim}; flex_attention "
                "compiled, with a document block mask; max |flex - mask|: outputs (and q grads) in fp32",
                ["batch x seq", "pass", "SDPA is_causal", "SDPA mask", "flex", "mask build", "block mask build",
                 "max |flex - mask|"], attention_rows)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

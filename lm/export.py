"""`python -m lm.export --checkpoint RUN --to hf OUT`: a checkpoint as a Hugging Face transformers model.

OUT gets config.json, model.safetensors, generation_config.json and the tokenizer's files (`lm.hf.export_files`): built
from a tiktoken encoding, or the tokenizer.json the model was trained with (data.tokenizer) copied.
The model's family lists the transformers classes it maps to (its `HFAdapter.targets`; docs/huggingface.md has the
table: GPT-2, Llama, the Qwen, OLMo and mixture-of-experts classes for the decoder, BERT for an encoder's masked-LM
head), then, last, lm's own modeling code for the family (LMDecoderForCausalLM, LMEncoderForMaskedLM,
LMEncDecForConditionalGeneration: `lm.hf.remote_code`), written beside the weights and loaded with
trust_remote_code=True. The first whose forward is the model's is written; a config none reproduces (the LSTM, a
fine-tuning head, a key newer than the code) is refused before anything is loaded or written, naming the keys that
differ. An encoder's export holds no tokenizer files: no tokenizer file knows its [MASK], [CLS] and padding ids, which
the tool prints instead.
"""

import argparse
import logging
import sys
from pathlib import Path

import torch

from lm.checkpoint.consolidated import read_consolidated_config
from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.store import (
    checkpoint_root,
    complete_checkpoints,
    enclosing_checkpoint,
    read_config,
    resolve_checkpoint,
)
from lm.cli import a_path, run
from lm.hf.export_files import output_problem, write_export
from lm.hf.importing import find_origin
from lm.hf.targets import pick_target
from lm.models.registry import family_of
from lm.tokenizer import model_tokenizer

log = logging.getLogger("lm.export")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.export",
        description="Export a checkpoint to another framework's format: --to hf writes a Hugging Face transformers "
                    "directory: the first transformers class of the model family's list whose forward is the model's "
                    "(docs/huggingface.md lists them: GPT-2, Llama, Qwen, OLMo, Mixtral, BERT, ...); any other "
                    "model as lm's own modeling code, loaded with trust_remote_code=True; an encoder gets no "
                    "tokenizer files).",
    )
    parser.add_argument("--checkpoint", required=True, type=a_path,
                        help="run directory, its checkpoints/, one step_XXXXXXXX directory, or a consolidated "
                             ".safetensors (lm.consolidate)")
    parser.add_argument("--to", required=True, choices=["hf"], help="hf: a Hugging Face transformers directory")
    parser.add_argument("out", type=a_path, metavar="OUT",
                        help="output directory (created; must be empty unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty OUT: replace the files the export writes, keep the others")
    args = parser.parse_args(argv)
    problem = output_problem(args.out, args.force)
    if problem:
        parser.error(problem)

    if Path(args.checkpoint).suffix == ".safetensors":  # a consolidated file (python -m lm.consolidate)
        step_dir = Path(args.checkpoint)
        saved = read_consolidated_config(step_dir)
    else:
        step_dir = resolve_checkpoint(args.checkpoint)
        saved = read_config(step_dir)
    if checkpoint_root(args.out).is_dir():  # lm's tools would read the run as this Hugging Face checkpoint
        parser.error(f"{args.out}: holds a run's checkpoints/, which an export there would hide from lm's tools; "
                     "export into a directory of its own")
    if complete_checkpoints(args.out):  # a run's checkpoints/ itself, which the tools take for its newest step
        parser.error(f"{args.out}: holds checkpoints (step_*), which an export there would hide from lm's tools; "
                     "export into a directory of its own")
    if (step := enclosing_checkpoint(args.out)) is not None:  # retention would delete the export with it
        parser.error(f"{args.out}: is inside the checkpoint {step}; export into a directory of its own")
    # refuse before loading weights or creating anything
    target = pick_target(saved.model, family_of(saved.model).hf.targets, saved.model.title)
    model, job, _ = load_for_inference(step_dir, torch.device("cpu"))
    out = args.out.resolve()
    tokenizer = model_tokenizer(job.data.tokenizer, job.model.vocab_size) if target.tokenizer_files else None
    origin = find_origin(step_dir, job.checkpoint.init_from)
    written, kept = write_export(model, target, tokenizer, job.data.tokenizer, out, origin)
    if kept:  # the paths as given, as the other tools name theirs
        log.warning("%s: kept files this export did not write: %s", args.out, ", ".join(kept))
    log.info("exported %s (step dir %s) as %s to %s: %s", args.checkpoint, step_dir.name, target.hf_class, args.out,
             ", ".join(written))
    if target.note is not None:
        log.info("%s", target.note(job.model, job.data.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

"""The baseline `lm.bench`'s corpus section sets lm.prepare against, in a process of its own:
`python -m lm.bench.datasets_map --tokenizer T --num-proc N --cache DIR FILE...`.

What a `datasets` user writes to tokenize JSON-lines files: `load_dataset("json", data_files=...)` (which
converts the rows into Arrow files in the cache) then `.map(batched=True, num_proc=N)` with a function that
encodes each document as ordinary text and appends the end-of-text token, as lm.prepare does, with the same
tokenizer loaded the same way (`lm.tokenizer.load_tokenizer`): tiktoken's `encode_ordinary` per document, or a
tokenizer.json's batch encoding. Prints one JSON object: documents, tokens, and the seconds of each step.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.bench.datasets_map", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--cache", required=True, help="datasets' cache_dir (its Arrow files go there)")
    parser.add_argument("--text-column", default="text")
    args = parser.parse_args()
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    import pyarrow.compute as pc

    from lm.tokenizer import HFTokenizer, load_tokenizer

    datasets.disable_progress_bars()
    enc = load_tokenizer(args.tokenizer)
    eot = enc.eot_token

    def tokenize(batch: dict) -> dict:
        texts = batch[args.text_column]
        if isinstance(enc, HFTokenizer):
            return {"ids": [ids + [eot] for ids in enc.encode_ordinary_batch(texts)]}
        return {"ids": [enc.encode_ordinary(text) + [eot] for text in texts]}

    start = time.perf_counter()
    rows = datasets.load_dataset("json", data_files=args.files, split="train", cache_dir=args.cache)
    loaded = time.perf_counter()
    tokens = rows.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=rows.column_names)
    mapped = time.perf_counter()
    count = pc.sum(pc.list_value_length(tokens.data.column("ids"))).as_py()
    print(json.dumps({"documents": len(tokens), "tokens": count, "load s": loaded - start, "map s": mapped - loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fsdp2kit's default attention of packed documents (the built-in corpus: docstrings packed into rows, the document
mask on) against a minimal hand-written `fully_shard` loop (reference_loop.py, each decoder layer, then the root) on
the same rows, twice: fed without position ids (`fsdp2_causal`: one causal sequence a row, documents attending to
each other, the loop as commonly written) and with them (`fsdp2_dense`: transformers' dense [T, T] document mask,
the same attention as fsdp2kit's, so the losses must agree).

The same 25M Llama, initial weights, fp32, AdamW, clipping and world size, run alternately; medians of the repeats.
Prints one JSON object: per world size each arm's tokens/s, peak RSS and losses, and the ratios fsdp2kit /
fsdp2_causal (the target: >= 0.97), fsdp2kit / fsdp2_dense.

Run: .venv/bin/python benchmarks/document_attention.py --world-sizes 1 2 --repeats 2 --seq-len 256
     .venv/bin/python benchmarks/document_attention.py --world-sizes 1 2 --repeats 2 --seq-len 2048 --batch 1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Arm, arms_main  # noqa: E402

if __name__ == "__main__":
    arms_main(
        "document_attention",
        [
            Arm("fsdp2kit", "fsdp2kit"),
            Arm("fsdp2_causal", "fsdp2", ("--without-position-ids",)),
            Arm("fsdp2_dense", "fsdp2"),
        ],
        [("fsdp2kit", "fsdp2_causal"), ("fsdp2kit", "fsdp2_dense")],
        "fsdp2kit's default attention of packed documents vs a minimal fully_shard loop without and with their "
        "position ids",
    )

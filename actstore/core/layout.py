"""Names and limits of a store's layout: the arrays of a segment, the tokenizer's folder, the largest
chunk and tokenizer file a reader accepts."""

from __future__ import annotations

SEGMENT_ARRAYS = ("z", "attn", "v", "resid", "mlp")
MAX_CHUNK_BYTES = 1 << 31  # a segment array chunk larger than this (uncompressed) is refused
TOKENIZER_DIR = (
    "tokenizer"  # the model's tokenizer files (save_pretrained); hashes in manifest model.tokenizer
)
MAX_TOKENIZER_FILE_BYTES = 1 << 28
WEIGHTS_MODES = ("shared", "copy", "none")  # where an ingest puts the weights (actstore.core.weight_store)

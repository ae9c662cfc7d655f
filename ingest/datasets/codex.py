"""CoDEx knowledge graphs (``train.txt``, ``valid.txt``, ``test.txt``: ``head<TAB>property<TAB>tail``
Wikidata ids per line).  They hold triples, not prompts: the predictors read them as a knowledge
graph (``actstore.query.analyses.predictors.KnowledgeGraph``), so this module only finds the files."""

from __future__ import annotations

from pathlib import Path

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import existing

SPLITS = ("train", "valid", "test")


def triple_files(path: str | Path) -> list[Path]:
    """The triple files of a CoDEx folder (``train``, ``valid``, ``test`` order), or one triple file.

    Raises :class:`DatasetError` when the path is missing or a folder holds none of the splits.
    """
    p = existing(path, "codex")
    if p.is_file():
        return [p]
    files = [p / f"{split}.txt" for split in SPLITS if (p / f"{split}.txt").is_file()]
    if not files:
        raise DatasetError(f"{p}: no CoDEx triple files ({', '.join(s + '.txt' for s in SPLITS)})")
    return files

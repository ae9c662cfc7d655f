"""The tuned lens's fitting rules and the spelling of stored translators, torch-free so that the
command line builds its options from them without loading the lens."""

from __future__ import annotations

from actstore.core.errors import LensError

TUNED_METHODS = ("adam", "sgd", "ridge")  # the tuned lens's fitting rules
CORPUS_PREFIX = "corpus:"  # --tuned corpus:STORE[#RUN]: translators a corpus-lens run stored


def check_tuned_method(method: str) -> None:
    """One error line unless ``method`` is a fitting rule of :data:`TUNED_METHODS` or names stored
    translators (``corpus:STORE`` or ``corpus:STORE#RUN_ID``)."""
    if method in TUNED_METHODS or (method.startswith(CORPUS_PREFIX) and len(method) > len(CORPUS_PREFIX)):
        return
    raise LensError(
        f"unknown tuned-lens method {method!r} (one of {', '.join(TUNED_METHODS)}, or corpus:STORE)"
    )

"""The method comparison's defaults (:mod:`actstore.query.methods`), torch-free so that the command
line builds ``actstore agree``'s options from them (``actstore.jobs.settings.AgreeConfig``) without
loading the methods: the methods compared, the key layer's plateau and the tuned lens's training."""

from __future__ import annotations

from actstore.core.errors import LensError

METHODS = ("trace", "patch", "probe", "attention", "logit_lens", "tuned_lens")
PLATEAU = 0.9  # key layer: the middle of the run of layers within this fraction of the peak

# The comparison's tuned-lens training: 250 steps of 64 facts (a full batch of ~2,000 facts costs about
# a minute per step on SmolLM2-135M on one CPU thread); the rest as the tuned-lens package.
COMPARISON_STEPS = 250
COMPARISON_BATCH = 64

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

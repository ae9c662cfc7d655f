"""The method comparison's defaults (:mod:`actstore.query.methods.readings`), torch-free so that the command
line builds ``actstore agree``'s options from them (``actstore.jobs.settings.AgreeConfig``) without
loading the methods: the methods compared, the key layer's plateau and the tuned lens's training."""

from __future__ import annotations

METHODS = ("trace", "patch", "probe", "attention", "logit_lens", "tuned_lens")
PLATEAU = 0.9  # key layer: the middle of the run of layers within this fraction of the peak

# The comparison's tuned-lens training: 250 steps of 64 facts (a full batch of ~2,000 facts costs about
# a minute per step on SmolLM2-135M on one CPU thread); the rest as the tuned-lens package.
COMPARISON_STEPS = 250
COMPARISON_BATCH = 64

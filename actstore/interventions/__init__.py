"""Interventions on a model's forward pass, and the experiments built on them.

* :mod:`actstore.interventions.runner`               batched forward passes with edits (:class:`InterventionRunner`),
                                                   head ablation and stored head means;
* :mod:`actstore.interventions.facts`                a store's facts, ready to trace or patch;
* :mod:`actstore.interventions.tracing`              causal tracing (ROME), with its settings and results in
                                                   :mod:`~actstore.interventions.trace_results` and the
                                                   incremental restorations in
                                                   :mod:`~actstore.interventions.tracing_incremental`;
* :mod:`actstore.interventions.patching`             activation patching between facts of one relation;
* :mod:`actstore.interventions.ablation`             the MAPS causal check (ablate a relation's heads).
"""

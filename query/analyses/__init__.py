"""The analyses over a selection: probes with HeadScore/TokenScore, lenses, predictors, shortcuts,
top-k contexts, their statistics and figures.  Rule: an analysis takes rows as a Selection and
imports the selection room and the core, never the method comparison, MAPS or the report."""

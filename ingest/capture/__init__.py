"""Fused capture: one forward pass per padded batch, the model's attention replaced by one that keeps
the per-head factors, in target mode (one position per prompt) and corpus mode (every kept position).
Rule: capture imports the models room and the core, never the query floor or the interventions."""

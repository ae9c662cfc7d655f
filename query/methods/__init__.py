"""The method comparison (An Empirical Study of Mechanistic Interpretability Approaches for Factual
Recall, ACL 2025): each method's reading of a fact, their agreement, chance levels and effects.
Rule: it builds on the analyses and the selection room; MAPS and the report are not its business."""

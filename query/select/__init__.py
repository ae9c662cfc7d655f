"""Selection and features: rows chosen by SQL, the features computed from their stored factors, the
training feed and the exports.  Rule: this room reads the store (the core) and nothing of the query
floor above it; every analysis starts from a :class:`~actstore.query.select.selection.Selection`."""

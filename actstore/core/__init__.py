"""The store core: format, manifest, arrays, tables, SQL, writer, verify, locks, run records."""

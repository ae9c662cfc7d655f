"""The jobs: each runs one command over a store and records the run."""

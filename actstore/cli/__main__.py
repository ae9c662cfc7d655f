"""``python -m actstore.cli``: the ``actstore`` command."""

from actstore.cli import main

if __name__ == "__main__":
    main()

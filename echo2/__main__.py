"""``python -m echo2``: the ``echo2`` command."""

from echo2.cli import main

if __name__ == "__main__":
    main()

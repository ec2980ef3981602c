"""``python -m echo2.cli``: the ``echo2`` command (how the fleet starts an actor, and torchrun a learner
process)."""

from echo2.cli import main

if __name__ == "__main__":
    main()

"""Entry point: ``python -m benchmarks --preset {smoke,cpu,gpu} [--out results.json]``."""

from benchmarks.runner import main

if __name__ == "__main__":
    main()

"""``python -m moe_lib.bench``: the benchmark's command line (:mod:`moe_lib.bench.cli`)."""

from .cli import main

if __name__ == "__main__":
    main()

"""``python -m dspark_hf.benchmarks``: ``dspark-hf bench`` (:mod:`dspark_hf.benchmarks.bench_cli`)."""

from .bench_cli import main

if __name__ == "__main__":
    main()

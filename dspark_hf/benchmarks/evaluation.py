"""``python -m dspark_hf.benchmarks.evaluation`` (named in docs, model cards and result files) runs
``dspark-hf evaluate`` (:mod:`dspark_hf.benchmarks.evaluate_cli`), as it did when the command lived here.

The library it held moved to :mod:`dspark_hf.benchmarks.acceptance` (which both this module and the command
import, so neither imports the other back); its names are re-exported here for code written against earlier
versions.
"""

from __future__ import annotations

from .acceptance import left_padded, measure_acceptance, tau_table

__all__ = ["left_padded", "measure_acceptance", "tau_table"]


if __name__ == "__main__":
    from .evaluate_cli import main

    main()

"""DSpark speculative decoding as a transformers ``custom_generate`` strategy.

    target.generate(**inputs, custom_generate="<this repository or folder>", trust_remote_code=True)

loads the DSpark draft stored in this repository (once per process, on the target's device and
dtype) and runs DSpark decoding: greedy or sampling, with exactly the output distribution of the
target alone. Every other ``generate`` argument works as usual; ``assistant_model=<a loaded DSpark
draft>`` uses that draft instead.

This file is only an entry point: the implementation is the installed ``dspark_hf`` package
(``pip install dspark-hf``, listed in ``requirements.txt``), see
``dspark_hf.custom_generate.run_custom_generate``. Nothing runs at import beyond that import.
"""

from dspark_hf.custom_generate import run_custom_generate


def generate(model, *args, **kwargs):
    return run_custom_generate(model, *args, _custom_generate_file=__file__, **kwargs)

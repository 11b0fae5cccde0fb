"""Remote code of a DSpark draft repository: the config class.

Loaded by ``AutoConfig.from_pretrained(<repo>, trust_remote_code=True)``. It only re-exports the
installed ``dspark_hf`` package (``pip install dspark-hf``), so there is one implementation and a
draft loaded this way is a ``dspark_hf.DSparkConfig``. Importing ``dspark_hf`` defines its classes,
registers them with transformers' auto classes and installs its ``generate`` dispatch; nothing else
runs at import (no network, no file access).
"""

from dspark_hf.configuration_dspark import DSparkConfig

__all__ = ["DSparkConfig"]

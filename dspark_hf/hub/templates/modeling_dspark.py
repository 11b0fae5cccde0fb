"""Remote code of a DSpark draft repository: the model class.

Loaded by ``AutoModel.from_pretrained(<repo>, trust_remote_code=True)``. It only re-exports the
installed ``dspark_hf`` package (``pip install dspark-hf``), so a draft loaded this way is a
``dspark_hf.DSparkDraftModel`` (strict loading from safetensors, one implementation). Importing
``dspark_hf`` defines its classes, registers them with transformers' auto classes and installs its
``generate`` dispatch; nothing else runs at import.
"""

from dspark_hf.modeling_dspark import DSparkDraftModel

__all__ = ["DSparkDraftModel"]

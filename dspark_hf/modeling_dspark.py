"""Public import path kept for Hub drafts and user code: ``dspark_hf.modeling_dspark`` is
``dspark_hf.model.modeling_dspark`` (the same module object, so monkeypatching and private names work).
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".model.modeling_dspark", __package__)

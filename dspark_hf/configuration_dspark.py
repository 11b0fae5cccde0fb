"""Public import path kept for Hub drafts and user code: ``dspark_hf.configuration_dspark`` is
``dspark_hf.model.configuration_dspark`` (the same module object, so monkeypatching and private names work).
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".model.configuration_dspark", __package__)

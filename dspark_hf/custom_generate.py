"""Public import path kept for Hub drafts and user code: ``dspark_hf.custom_generate`` is
``dspark_hf.decoding.custom_generate`` (the same module object, so monkeypatching and private names work).
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".decoding.custom_generate", __package__)

"""autoprec inside training frameworks: a Lightning precision plugin and a Hugging Face Trainer.

Nothing heavy is imported here: ``autoprec.integrations.lightning`` needs ``lightning`` and
``autoprec.integrations.transformers`` needs ``transformers`` (``pip install autoprec[integrations]``);
each is imported only when its name is first used.

    from autoprec.integrations import AutoprecPrecision   # imports lightning now
    from autoprec.integrations import AutoprecTrainer     # imports transformers now
"""

from __future__ import annotations

import importlib

from ..errors import IntegrationError

__all__ = ["AutoprecPrecision", "AutoprecTrainer", "IntegrationError", "scheduler_metrics"]

_LAZY = {
    "AutoprecPrecision": "lightning",
    "AutoprecTrainer": "transformers",
    "scheduler_metrics": "_metrics",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoprec.integrations' has no attribute {name!r}")

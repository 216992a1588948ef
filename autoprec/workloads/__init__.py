"""The built-in workloads: examples of the `autoprec.workload.Workload` protocol that the CLI's
defaults, the examples and the benchmarks train. The core library never imports this package.

- `bytelm`: a byte-level GPT-style LM on Python's own docs (no download); ``default_workload``.
- `finetune`: the pretrained all-MiniLM-L6-v2 fine-tuned on BBC News topics
  (``minilm_finetune_workload``; needs the ``minilm`` extra).
- `minilm`: loading that pretrained model and its tokenizer offline.

The byte LM's names are re-exported here: ``from autoprec.workloads import default_workload``.
"""

from .bytelm import *  # noqa: F401,F403
from .bytelm import __all__ as __all__

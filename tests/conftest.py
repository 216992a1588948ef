"""Test-wide settings."""

import torch

# The test models are small, so a second intra-op thread buys little, while two OpenMP threads on
# two cores that another process also uses spin-wait: a 10 s training test was measured at 331 s
# that way. One thread keeps the suite's time steady on a shared machine.
torch.set_num_threads(1)

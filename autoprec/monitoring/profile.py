"""A `Profile` as TensorBoard events: per layer and tensor kind, histograms of log2|x|, the amax
per step, sampled zero and non-finite counts, and the gradient noise-to-signal ratio."""

from __future__ import annotations

import math
import os
from typing import Any, Optional, cast

import numpy as np

from ..profiling import Profile

__all__ = ["write_tensorboard"]


def write_tensorboard(profile: Profile, logdir: "str | os.PathLike | Any", step: Optional[int] = None) -> None:
    """Write ``profile`` as TensorBoard events under ``logdir`` (or into a ``SummaryWriter``).

    Per layer and tensor kind: histograms of log2|x| (``absolute``) and of log2(|x|/amax)
    (``current``) from the on-device bins (`add_histogram_raw`, zeros and non-finite values left
    out, as they have no logarithm), the amax per step as a scalar, and the sampled zero and
    non-finite counts. Tags: ``<kind>/<layer>/...``, so TensorBoard groups by kind.
    """
    from torch.utils.tensorboard import SummaryWriter

    own = not hasattr(logdir, "add_histogram_raw")
    writer = SummaryWriter(log_dir=str(logdir)) if own else cast(SummaryWriter, logdir)  # duck-typed: a writer of the caller's
    global_step = profile.steps if step is None else step
    try:
        for fqn, lp in profile.layers.items():
            fqn = profile.layer_name(fqn)  # tags name a one-layer model's root by its class
            for kind, ts in lp.tensors.items():
                for ref, name in (("absolute", "log2_abs"), ("current", "log2_abs_over_amax")):
                    buckets = ts.histograms[ref].log2_buckets()
                    if buckets is None:
                        continue
                    lows, limits, counts = buckets
                    centres = (np.array(lows) + np.array(limits)) / 2
                    weights = np.array(counts, dtype=np.float64)
                    writer.add_histogram_raw(
                        f"{kind}/{fqn}/{name}",
                        min=lows[0], max=limits[-1], num=int(weights.sum()),
                        sum=float((centres * weights).sum()), sum_squares=float((centres**2 * weights).sum()),
                        bucket_limits=limits, bucket_counts=counts, global_step=global_step,
                    )
                for t, value in enumerate(ts.amax):
                    if math.isfinite(value):
                        writer.add_scalar(f"{kind}/{fqn}/amax", value, t)
                writer.add_scalar(f"{kind}/{fqn}/zero_fraction", ts.zeros / ts.sampled if ts.sampled else 0.0, global_step)
                writer.add_scalar(f"{kind}/{fqn}/nonfinite_steps", ts.nonfinite_steps, global_step)
            if lp.param_grad is not None and math.isfinite(lp.param_grad.nsr):
                writer.add_scalar(f"grad/{fqn}/noise_to_signal", lp.param_grad.nsr, global_step)
        writer.flush()
    finally:
        if own:
            writer.close()

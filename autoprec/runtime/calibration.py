"""INT8 activation calibration: observed ranges → a frozen scale, with outlier channels apart.

For the first ``Calibration.batches`` forward passes a layer quantizes with each batch's own range
(dynamic max) while an `Int8Calibrator` keeps, per input channel, the exact running amax and a
deterministic subsample of rows. Then it freezes:

1. Outlier channels: input channels whose amax exceeds ``outlier_ratio`` × the median channel
   amax are computed apart in FP32 (LLM.int8(), arXiv:2208.07339: a handful of feature dimensions
   carry magnitudes that would take the whole INT8 range).
2. The clipping range of the remaining channels, by ``method``: ``max`` (no clipping), ``percentile``
   of |x|, or ``mse`` (the clip with the smallest quantization MSE over the sampled values, a grid
   search as in NVIDIA's pytorch-quantization / TensorRT calibrators).

The relative quantization error of the chosen scale and of naive max scaling on the sampled
activations is kept in `report`, so a run can show what calibration bought.
"""

from __future__ import annotations

import torch

from ..formats import Format, Granularity, amax, fake_quantize, scale_from_amax
from ..plan import Calibration, CalibrationMethod

__all__ = ["Int8Calibrator"]

_ROWS_PER_BATCH = 256  # rows (tokens) sampled per calibration batch; exact per-channel amax kept
_MSE_GRID = 100  # clip candidates between 1% and 100% of amax


class Int8Calibrator:
    """Calibration state of one INT8 activation operand (K input channels)."""

    def __init__(self, calibration: Calibration, granularity: Granularity = Granularity.TENSOR):
        self.calibration = calibration
        self.granularity = Granularity(granularity)
        self.observed = 0
        self.channel_amax: "torch.Tensor | None" = None
        self.samples: list[torch.Tensor] = []
        self.frozen_scale: "torch.Tensor | None" = None
        self.outliers = torch.zeros(0, dtype=torch.long)
        self.report: dict = {}

    @property
    def calibrating(self) -> bool:
        return self.frozen_scale is None and self.granularity is Granularity.TENSOR

    def observe(self, a: torch.Tensor) -> None:
        """Record a (M, K) activation while calibrating; freezes after the configured batches.

        Costs one reduction and a strided row gather per call; the freeze syncs once.
        """
        if not self.calibrating:
            return
        a = a.detach()
        ch = a.abs().amax(dim=0).float()
        self.channel_amax = ch if self.channel_amax is None else torch.maximum(self.channel_amax, ch)
        step = max(1, a.shape[0] // _ROWS_PER_BATCH)
        self.samples.append(a[::step][:_ROWS_PER_BATCH].float().clone())
        self.observed += 1
        if self.outliers.device != a.device:
            self.outliers = self.outliers.to(a.device)
        if self.observed >= self.calibration.batches:
            self.freeze()

    def scale(self, a_main: torch.Tensor) -> torch.Tensor:
        """The activation scale to use now: frozen, else this batch's own (per tensor or per row)."""
        if self.granularity is Granularity.ROW:
            return scale_from_amax(amax(a_main, Granularity.ROW), Format.INT8)
        if self.frozen_scale is not None:
            return self.frozen_scale
        return scale_from_amax(amax(a_main), Format.INT8)

    def recalibrate(self) -> None:
        """Forget the frozen scale and observe the next ``batches`` passes again."""
        self.observed = 0
        self.channel_amax = None
        self.samples = []
        self.frozen_scale = None
        self.outliers = self.outliers.new_zeros(0)

    def freeze(self) -> None:
        cal = self.calibration
        samples = torch.cat(self.samples)
        channel_amax = self.channel_amax
        outliers = channel_amax.new_zeros(0, dtype=torch.long)
        if cal.outlier_ratio is not None and channel_amax.numel() > 1:
            median = channel_amax.median()
            outliers = torch.nonzero(channel_amax > cal.outlier_ratio * median).flatten()
        keep = torch.ones(channel_amax.numel(), dtype=torch.bool, device=channel_amax.device)
        keep[outliers] = False
        main = samples[:, keep]
        values = main.abs().flatten()
        full_max = channel_amax[keep].max() if keep.any() else channel_amax.new_zeros(())
        clip = self._clip(values, full_max, cal)
        self.frozen_scale = scale_from_amax(clip, Format.INT8)
        self.outliers = outliers
        self.report = self._errors(samples, keep, clip)
        self.samples = []

    @staticmethod
    def _clip(values: torch.Tensor, full_max: torch.Tensor, cal: Calibration) -> torch.Tensor:
        if cal.method is CalibrationMethod.MAX or values.numel() == 0:
            return full_max
        if cal.method is CalibrationMethod.PERCENTILE:
            # torch.quantile caps its input at 2**24 elements; the sample stays far below that.
            return torch.quantile(values, cal.percentile / 100.0).clamp(max=full_max)
        candidates = full_max * torch.linspace(0.01, 1.0, _MSE_GRID, device=values.device)
        errors = torch.stack([(fake_quantize(values, Format.INT8, scale_from_amax(c, Format.INT8)) - values).pow(2).mean() for c in candidates])
        return candidates[errors.argmin()]

    @staticmethod
    def _errors(samples: torch.Tensor, keep: torch.Tensor, clip: torch.Tensor) -> dict:
        """Relative L2 error ‖x − q(x)‖/‖x‖ on the sampled rows: naive max vs the calibration."""
        norm = samples.norm().clamp_min(1e-30)
        naive = fake_quantize(samples, Format.INT8)
        calibrated = samples.clone()
        calibrated[:, keep] = fake_quantize(samples[:, keep], Format.INT8, scale_from_amax(clip, Format.INT8))
        return {
            "naive_max_rel_error": float((samples - naive).norm() / norm),
            "calibrated_rel_error": float((samples - calibrated).norm() / norm),
            "outlier_channels": int((~keep).sum()),
            "clip": float(clip),
            "amax": float(samples.abs().max()),
        }

    def state_dict(self) -> dict:
        return {
            "observed": self.observed,
            "channel_amax": self.channel_amax,
            "samples": list(self.samples),
            "frozen_scale": self.frozen_scale,
            "outliers": self.outliers,
            "report": dict(self.report),
        }

    def load_state_dict(self, state: dict) -> None:
        self.observed = int(state["observed"])
        self.channel_amax = state["channel_amax"]
        self.samples = list(state["samples"])
        self.frozen_scale = state["frozen_scale"]
        self.outliers = state["outliers"]
        self.report = dict(state["report"])

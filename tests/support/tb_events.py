"""Reading TensorBoard event files back in tests, with TensorBoard's own reader."""

from tensorboard.backend.event_processing import event_accumulator


def accumulator(path) -> event_accumulator.EventAccumulator:
    """Every event of the run at ``path`` (no sampling: size guidance 0 keeps them all)."""
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    return acc


def text_of(acc, tag) -> str:
    """The latest text summary under ``tag``."""
    return acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode("utf-8")


def image_of(event):
    """An image event decoded: ``(height, width, 3)`` uint8 RGB, read by matplotlib from its PNG."""
    import io

    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(io.BytesIO(event.encoded_image_string), format="png")
    if pixels.dtype != np.uint8:  # PNG reads as floats in [0, 1]
        pixels = np.round(pixels * 255).astype(np.uint8)
    return pixels[..., :3]

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

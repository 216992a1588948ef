"""Gradient communication between ranks: what a DDP bucket sends and the error it leaves
behind (`buckets`), and which method each layer's gradients take, from the link's measured cost
and the compression's predicted loss (`choice`). Imports the shared basics; the scheduler's
`distributed` agreement runs it."""

from ..formats import PER_LAYER_COMM, CommMethod
from .buckets import BucketCommunicator, CommSettings, ErrorFeedback, bytes_sent, dequantize_chunks, quantize_chunks

__all__ = ["PER_LAYER_COMM", "CommMethod", "CommSettings", "ErrorFeedback", "BucketCommunicator", "bytes_sent", "quantize_chunks", "dequantize_chunks"]

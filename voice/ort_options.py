"""ONNX Runtime sessions that share two cores with the LLM.

The model's passes run on an OpenMP pool that takes every core; an ONNX Runtime pool
whose idle threads spin beside it takes cores those passes need (Moonshine: 2 spinning
threads took 472 ms a transcription under contention, where 1 thread took 175 ms). So
the voice engines that run beside the model (Moonshine, Piper) let idle threads sleep.
"""

from __future__ import annotations

__all__ = ["sleeping_threads"]


def sleeping_threads(threads: int):
    """CPU session options: `threads` intra-op threads (at least 1), one inter-op thread,
    and no spinning when idle."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options

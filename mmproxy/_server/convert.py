"""Turning DALI outputs into torch tensors: dense, per-sample, or padded; CPU or GPU."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch

from mmproxy.refs import PaddedBatch

Output = Any  # torch.Tensor | list[torch.Tensor] | PaddedBatch


def pad(samples: list[torch.Tensor]) -> PaddedBatch:
    """Pads samples of one rank and dtype with zeros to the largest extent along every axis."""
    if not samples:
        return PaddedBatch(torch.empty(0), torch.empty(0, dtype=torch.int64))
    ndim = samples[0].dim()
    shapes = torch.tensor([list(s.shape) for s in samples], dtype=torch.int64).reshape(len(samples), ndim)
    size = shapes.max(dim=0).values.tolist()
    if samples[0].is_cuda or samples[0].dtype == torch.bfloat16:  # (numpy has no bfloat16)
        data = samples[0].new_zeros((len(samples), *size))
        target: Any = data
    else:  # numpy's copies: a server thread's torch copies would wake the intra-op thread pool
        target = np.zeros((len(samples), *size), dtype=samples[0].numpy().dtype)
        data = torch.from_numpy(target)
    for i, s in enumerate(samples):
        region: Any = (i, *(slice(0, n) for n in s.shape))
        target[region] = s if target is data else s.numpy()
    return PaddedBatch(data, shapes[:, 0].clone() if ndim == 1 else shapes)


def _cpu(tensor: Any, copy: bool) -> torch.Tensor:
    out = torch.from_dlpack(tensor)
    return out.clone() if copy else out


def _gpu(tensor: Any, stream: Any) -> torch.Tensor:
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    device = torch.device("cuda", tensor.device_id())
    out = torch.empty(tensor.shape(), dtype=to_torch_type[tensor.dtype], device=device)
    feed_ndarray(tensor, out, cuda_stream=stream)
    return out


def _gpu_samples(tensor_list: Any, stream: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """A GPU output of samples of different shapes copied in one go: the samples back to back
    in one flat tensor, and their shapes."""
    import ctypes

    from nvidia.dali.plugin.pytorch import to_torch_type

    shapes = [list(s) for s in tensor_list.shape()]
    total = sum(math.prod(s) for s in shapes)
    flat = torch.empty(total, dtype=to_torch_type[tensor_list.dtype],
                       device=torch.device("cuda", tensor_list.device_id()))
    if total:
        raw = None if stream is None else ctypes.c_void_p(stream.cuda_stream)
        tensor_list.copy_to_external(ctypes.c_void_p(flat.data_ptr()), raw,
                                     non_blocking=stream is not None)
    return flat, shapes


def _gpu_ragged(tensor_list: Any, stream: Any, want_pad: bool) -> Output:
    """A GPU output whose samples differ in shape: one copy, then views of it; padded, 1-D
    samples (audio) in one kernel, others a copy a view, all queued on the stream (a mask or
    an index built on the GPU would make the thread wait for the stream, with the GIL held)."""
    flat, shapes = _gpu_samples(tensor_list, stream)
    if not shapes:
        return pad([]) if want_pad else []
    if all(len(s) == 1 for s in shapes):
        lengths = [s[0] for s in shapes]
        if want_pad:
            return _pad_flat(flat, lengths)
        return list(torch.split(flat, lengths))
    samples = [part.view(shape) for part, shape in
               zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]
    return pad(samples) if want_pad else samples


def _pad_flat(flat: torch.Tensor, lengths: list[int]) -> PaddedBatch:
    """1-D samples back to back in ``flat``, zero-padded into one batch by one kernel (the op
    behind PyTorch's jagged nested tensors). The samples' offsets go to the GPU from pinned
    memory, queued on the stream: from pageable memory CUDA first waits for the stream, the
    runner thread spinning meanwhile."""
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    try:
        offsets = offsets.pin_memory()
    except RuntimeError:  # no page-locked memory left: sent from pageable memory, waiting
        pass
    try:
        data = torch.ops.aten._jagged_to_padded_dense_forward(
            flat.view(-1, 1), [offsets.to(flat.device, non_blocking=True)], [max(lengths)], 0.0)
    except (AttributeError, NotImplementedError, RuntimeError):  # a torch without it, or a dtype
        return pad(list(torch.split(flat, lengths)))
    return PaddedBatch(data.view(len(lengths), -1), torch.tensor(lengths, dtype=torch.int64))


def to_torch(tensor_list: Any, *, copy: bool, want_pad: bool, stream: Any = None) -> Output:
    """Converts one DALI output (a TensorList) to torch.

    With ``want_pad`` the result is always a :class:`PaddedBatch`, even when the samples
    happen to share a shape.

    CPU outputs of a dynamic-executor pipeline are wrapped without a copy (DLPack; DALI does not
    reuse memory that is still referenced). GPU outputs are copied into tensors of PyTorch's
    caching allocator on ``stream``, so their lifetime follows PyTorch's stream rules: all of an
    output's samples in one copy (samples of different shapes are views of it, or padded from it
    on the GPU).
    """
    from nvidia.dali.backend import TensorListGPU

    gpu = isinstance(tensor_list, TensorListGPU)
    if tensor_list.is_dense_tensor():
        whole = tensor_list.as_tensor()
        dense = _gpu(whole, stream) if gpu else _cpu(whole, copy)
        if not want_pad:
            return dense
        shapes = torch.tensor(dense.shape[1:], dtype=torch.int64).repeat(dense.shape[0], 1)
        return PaddedBatch(dense, shapes[:, 0].clone() if dense.dim() == 2 else shapes)
    if gpu:
        return _gpu_ragged(tensor_list, stream, want_pad)
    samples = [_cpu(t, copy) for t in tensor_list]
    return pad(samples) if want_pad else samples


def select(output: Output, rows: tuple[int, ...] | None) -> Output:
    """Picks batch rows (used when one call appears several times in a field)."""
    if rows is None:
        return output
    if isinstance(output, PaddedBatch):
        index = torch.tensor(rows, dtype=torch.int64, device=output.data.device)
        return PaddedBatch(output.data[index], output.lengths[torch.tensor(rows, dtype=torch.int64)])
    if isinstance(output, torch.Tensor):
        return output[torch.tensor(rows, dtype=torch.int64, device=output.device)]
    return [output[r] for r in rows]


def tensors_of(output: Output) -> list[torch.Tensor]:
    if isinstance(output, PaddedBatch):
        return [output.data]
    if isinstance(output, torch.Tensor):
        return [output]
    return list(output)

"""Write an HF safetensors file from a stream of (name, tensor) pairs, one tensor in memory at a time.

A safetensors file is a JSON header (every tensor's dtype, shape and byte range) followed by the raw
bytes. The policy knows every exported tensor's name, shape and dtype before it gathers any of them
(the source checkpoint's shapes, the model's dtypes), so the header is written first and the tensors
are appended as the TP-gathered export stream produces them. The result is one ordinary
``model.safetensors`` (readable by ``safetensors.safe_open`` / vLLM) without the whole state dict ever
being held.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from skyrl_mtp.models.families.packed_experts import PackedExperts

_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class StreamExportError(ValueError):
    """The stream did not produce exactly the tensors (names, shapes, dtypes, order) announced."""


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_safetensors_stream(path: str | Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                             tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict | None = None,
                             packed: PackedExperts | None = None) -> Path:
    """Write ``tensors`` (in ``layout`` order: name, shape, dtype) to ``path``; each is checked against
    its announced entry. With ``packed``, per-expert tensors of the stream are written into the checkpoint's
    packed expert tensors, each at its byte offset (the file then holds the packed names). Returns the path."""
    if packed:
        stored, pieces = packed.stored_layout(layout)
    else:
        stored, pieces = list(layout), [(name, 0) for name, _, _ in layout]
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    start: dict[str, int] = {}
    offset = 0
    for name, shape, dtype in stored:
        if dtype not in _DTYPE_CODES:
            raise StreamExportError(f"{name}: dtype {dtype} cannot be written to safetensors")
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        start[name] = offset
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    it = iter(tensors)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            f.truncate(data_start + offset)
            for (name, shape, dtype), (where, at) in zip(layout, pieces):
                try:
                    got_name, t = next(it)
                except StopIteration:
                    raise StreamExportError(f"export stream ended before {name!r}") from None
                if got_name != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise StreamExportError(f"export stream gave {got_name!r} {tuple(t.shape)} {t.dtype}; "
                                            f"expected {name!r} {tuple(shape)} {dtype}")
                f.seek(data_start + start[where] + at)
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        leftover = next(it, None)
        if leftover is not None:
            raise StreamExportError(f"export stream gave more tensors than announced (first extra: {leftover[0]!r})")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path

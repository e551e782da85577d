"""The loader's GGUF reader (gguf's, over a plain view of the memory map) reads exactly what
gguf's own reader reads."""

from __future__ import annotations

import gguf
import numpy as np

from tokenmill.models.gguf_loader import open_gguf


def test_reader_reads_what_gguf_reads(default_model):
    ours, theirs = open_gguf(default_model.path), gguf.GGUFReader(str(default_model.path))
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert len(mine.parts) == len(field.parts), name
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes()
                   for a, b in zip(mine.parts, field.parts)), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (
            tensor.name, tensor.tensor_type, tensor.data_offset)
        assert np.array_equal(mine.shape, tensor.shape) and np.array_equal(mine.data, tensor.data)

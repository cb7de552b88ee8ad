"""GgufFile reads what gguf's own GGUFReader reads: every metadata value and every tensor."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from common.model.gguf_file import GgufFile


def _same_as_gguf_reader(path, nested: tuple[str, ...] = ()) -> None:
    """`nested`: arrays of arrays, which GGUFReader's `contents()` flattens into one list."""
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    flattened = {k: [item for inner in ours.fields[k] for item in inner] for k in nested}
    assert ours.fields | flattened == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.data.dtype, a.data.shape) == (b.tensor_type, b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name


def test_the_default_model_reads_as_gguf_reads_it(model_path):
    _same_as_gguf_reader(model_path)


def test_every_value_type_and_an_unaligned_tensor(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.strs", ["a", "", "ü b"])
    writer.add_array("t.nested", [["x", "y"], ["z"]])
    writer.add_tensor("odd", np.arange(7, dtype=np.float32))
    writer.add_tensor("half", np.arange(12, dtype=np.float16).reshape(3, 4))
    writer.add_tensor("q8", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                                                 gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_gguf_reader(path, nested=("t.nested",))
    assert GgufFile(path).fields["t.nested"] == [["x", "y"], ["z"]]


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufFile(path)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_dequantized_values_are_ggufs_bit_for_bit(kind):
    """Random blocks (any bits, scales of every magnitude, NaN and infinities included) of the types
    dequantized here, and one left to gguf, give exactly gguf.quants.dequantize's float32 values."""
    from common.model.gguf_dequant import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, per_row = 6, 4 * block
    data = np.random.default_rng(7).integers(0, 256, rows * per_row // block * size, dtype=np.uint8)
    if kind in ("F32", "F16"):  # elements, as GgufFile gives them; every other type as bytes
        data = data.view({"F32": np.float32, "F16": np.float16}[kind]).reshape(rows, per_row)
    else:
        data = data.reshape(rows, per_row // block * size)
    ours = dequantize(data, qtype, (rows, per_row))
    theirs = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    assert ours.dtype == np.float32 and ours.flags.writeable and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # NaNs too, bit for bit

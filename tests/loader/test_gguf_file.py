"""The loader's own GGUF reader (``tokenmill.loader.gguf_file``) against ``gguf.GGUFReader``: the
same metadata values and the same tensor views (type, shape, dtype, offset, bytes) on the shipped
default model and on files written here with every value type, both byte orders and a custom
alignment; damaged files are refused with a clear error, never read past their end."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.loader.gguf import _open, read_gguf
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model_path

VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def assert_same_as_reader(path: Path, skip: tuple[str, ...] = (), ref: gguf.GGUFReader | None = None) -> GGUFFile:
    ours, ref = GGUFFile(path, skip=skip), ref or gguf.GGUFReader(str(path))
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # the reader's header pseudo-fields
    expected_keys = {k + ".len" if k in skip else k for k in ref_fields}
    assert set(ours.fields) == expected_keys
    for key, field in ref_fields.items():
        if key in skip:
            assert ours.fields[key + ".len"] == len(field.data), key
        else:
            value = ours.fields[key]
            if isinstance(value, list) and value and isinstance(value[0], list):
                value = [x for part in value for x in part]   # the reader flattens nested arrays
            assert value == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
        assert not a.data.flags.writeable
    return ours


def test_default_model_file_reads_as_the_reference_reader_does():
    path = resolve_model_path(DEFAULT_MODEL)
    ref = gguf.GGUFReader(str(path))   # seconds: read once for both checks
    full = assert_same_as_reader(path, ref=ref)
    assert len(full.fields["tokenizer.ggml.tokens"]) == 49152
    skipped = assert_same_as_reader(path, skip=VOCAB, ref=ref)
    assert skipped.fields["tokenizer.ggml.merges.len"] == len(full.fields["tokenizer.ggml.merges"])
    assert "tokenizer.ggml.tokens" not in skipped.fields


def _every_value_type(w: gguf.GGUFWriter) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, ✓")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 3.141592653589793)
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_written_files_read_as_the_reference_reader_does(tmp_path, endian, alignment):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    _every_value_type(w)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("vec", x[0])
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (Q.Q8_0, Q.Q4_1):
        w.add_tensor(qtype.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = assert_same_as_reader(path)
    assert ours.fields["t.str"] == "héllo, ✓" and ours.fields["t.nested"] == [[1, 2], [3]]
    assert ours.fields["t.u64"] == 2**63 + 5
    f32 = next(t for t in ours.tensors if t.name == "f32")
    assert np.array_equal(np.asarray(f32.data, dtype=np.float32), x)
    if alignment:
        assert all(t.data_offset % alignment == 0 for t in ours.tensors)
    assert_same_as_reader(path, skip=VOCAB)


@pytest.fixture
def small_file(tmp_path) -> Path:
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    _every_value_type(w)
    w.add_tensor("w", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_truncation_is_refused_with_a_clear_error(small_file, tmp_path):
    data = small_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    # every cut inside the header and tables, and a few inside the tensor bytes
    ends = sorted(set(range(0, GGUFFile(small_file).data_start, 7)) | {len(data) - 1, len(data) - 200})
    for end in ends:
        cut.write_bytes(data[:end])
        with pytest.raises(ModelLoadError, match="corrupt GGUF file"):
            _open(cut)


def test_bad_version_and_alignment_are_named(small_file, tmp_path):
    data = bytearray(small_file.read_bytes())
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(bytes(data[:4]) + (1).to_bytes(4, "little") + bytes(data[8:]))
    with pytest.raises(ModelLoadError, match="GGUF version 1 is not supported"):
        _open(v1)
    path = tmp_path / "align.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 48)
    w.add_tensor("w", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="general.alignment 48 is not a power of two"):
        _open(path)


def test_default_model_loads_through_it():
    """The served path reads the shipped file with the vocabulary skipped (its time against
    GGUFReader's is measured by benchmarks/startup.py, not here) and still gets every weight."""
    path = resolve_model_path(DEFAULT_MODEL)
    f = _open(path)
    assert f.fields["tokenizer.ggml.tokens.len"] == 49152 and "tokenizer.ggml.tokens" not in f.fields
    ck = read_gguf(path, native=True)
    assert ck.config.vocab_size == 49152 and len(ck.weights) == 272


@pytest.mark.parametrize("native", [True, False], ids=["native", "fp32"])
def test_reference_reader_switch_loads_the_same_checkpoint(tiny_llama_dir, tmp_path, monkeypatch, native):
    """TOKENMILL_GGUF_READER=gguf (the A/B switch) reads through GGUFReader: same config, same weights."""
    import torch
    from test_loader_gguf import write_model_gguf

    path = write_model_gguf(tiny_llama_dir, tmp_path / "m.gguf", "llama")
    ours = read_gguf(path, native=native)
    monkeypatch.setenv("TOKENMILL_GGUF_READER", "gguf")
    assert not isinstance(_open(path), GGUFFile)
    ref = read_gguf(path, native=native)
    assert ours.config.to_dict() == ref.config.to_dict()
    assert ours.weights.keys() == ref.weights.keys()
    for name, w in ours.weights.items():
        r = ref.weights[name]
        if isinstance(w, torch.Tensor):
            assert torch.equal(w, r), name
        else:   # a quantized linear method (an nn.Module): the same packed tensors
            a, b = w.state_dict(), r.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

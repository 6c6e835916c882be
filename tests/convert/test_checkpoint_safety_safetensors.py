"""Forged safetensors headers are refused with the file named, before anything is sized from them.

Each case is a hand-made file (8-byte little-endian header length + JSON header + data) that lies in
one way. Before the header checks, most of them got past the reader and failed later with raw
errors (KeyError 'Q7', a reshape RuntimeError), or read what was not a tensor; the zero-span
tensor of shape [2**33] F64 asked ``torch.empty`` for 64 GiB. Now each raises ``ConversionError``
naming the file and the problem, from ``SafetensorsReader`` (so from ``convert inspect`` and
``hf-to-megatron`` too) without reading any tensor.
"""

import json
import os
import struct

import pytest
import torch

from megatron_cascade.convert import ConversionError
from megatron_cascade.convert import safetensors_io
from megatron_cascade.convert.safetensors_io import INDEX_FILE, SINGLE_FILE, SafetensorsReader


def _forge(path: str, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _f32(shape, begin, end) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


CASES = {
    # name: (header, data, header_len, message fragment)
    "header_longer_than_file": ({"w": _f32([1], 0, 4)}, b"\0" * 4, 1 << 40, "is truncated or not safetensors"),
    "header_not_utf8_json": (b"\xff\xfe{not json", b"", None, "corrupt safetensors header: UnicodeDecodeError"),
    "header_not_an_object": (b"[1, 2]", b"", None, "a JSON list, not an object"),
    "unknown_dtype": ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None,
                      "unknown dtype 'Q7'"),
    "negative_shape": ({"w": _f32([-1, 2], 0, 8)}, b"\0" * 8, None, "not a list of non-negative ints"),
    "fields_missing": ({"w": {"dtype": "F32"}}, b"", None, "lacks dtype, shape or data_offsets"),
    "offsets_reversed": ({"w": _f32([2], 8, 0)}, b"\0" * 8, None, "not [begin, end] with 0 <= begin <= end"),
    "span_smaller_than_shape": ({"w": _f32([4], 0, 8)}, b"\0" * 8, None,
                                "spans 8 bytes, its shape [4] of F32 needs 16"),
    "64_GiB_from_an_empty_span": ({"w": {"dtype": "F64", "shape": [2**33], "data_offsets": [0, 0]}}, b"", None,
                                  "needs 68719476736"),
    "span_past_end_of_file": ({"w": {"dtype": "F64", "shape": [2**33], "data_offsets": [0, 2**36]}}, b"\0" * 8,
                              None, "is truncated: tensor 'w' needs bytes up to"),
    "overlapping_tensors": ({"a": _f32([4], 0, 16), "b": _f32([4], 8, 24)}, b"\0" * 24, None, "share bytes"),
    "name_listed_twice": (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                          b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8, None,
                          "['w'] listed twice"),
    "metadata_not_an_object": ({"__metadata__": [1], "w": _f32([1], 0, 4)}, b"\0" * 4, None,
                               "__metadata__ is not an object"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forged_header_is_refused_naming_the_file(tmp_path, case):
    header, data, header_len, fragment = CASES[case]
    path = _forge(str(tmp_path / SINGLE_FILE), header, data, header_len)
    with pytest.raises(ConversionError) as err:
        SafetensorsReader(str(tmp_path)).get("w")
    assert path in str(err.value) and fragment in str(err.value), str(err.value)


def test_header_over_the_format_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "MAX_HEADER_BYTES", 32)
    path = _forge(str(tmp_path / SINGLE_FILE), {"w": _f32([1], 0, 4), "__metadata__": {"format": "pt"}}, b"\0" * 4)
    with pytest.raises(ConversionError, match="more than the format's limit of 32"):
        SafetensorsReader(str(tmp_path))
    assert os.path.exists(path)


def test_index_naming_a_shard_outside_the_directory_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    _forge(str(tmp_path / "outside.safetensors"), {"w": _f32([1], 0, 4)}, b"\0" * 4)
    (tmp_path / "ckpt" / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(ConversionError, match="names shard '../outside.safetensors', which is not a file name inside"):
        SafetensorsReader(str(tmp_path / "ckpt"))


def test_tensor_in_two_shards_is_refused(tmp_path):
    for name in ("a.safetensors", "b.safetensors"):
        _forge(str(tmp_path / name), {"w": _f32([1], 0, 4)}, b"\0" * 4)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    with pytest.raises(ConversionError, match="tensor 'w' is in both"):
        SafetensorsReader(str(tmp_path))


def test_valid_file_with_every_dtype_still_reads(tmp_path):
    from safetensors.torch import save_file

    tensors = {name: torch.arange(6).reshape(2, 3).to(dtype) for name, dtype in safetensors_io.DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    reader = SafetensorsReader(str(tmp_path))
    for name, want in tensors.items():
        assert torch.equal(reader.get(name).float(), want.float()), name


def test_inspect_reports_a_forged_header_in_one_line(tmp_path, capsys):
    from megatron_cascade.convert.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    path = _forge(str(tmp_path / SINGLE_FILE), *CASES["64_GiB_from_an_empty_span"][:2])
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and path in err and "needs 68719476736" in err and "\n" not in err, err

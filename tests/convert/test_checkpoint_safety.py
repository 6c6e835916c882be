"""A hostile checkpoint runs no code: every pickle a load path meets is refused unless it holds plain data.

The attack: a checkpoint file that is a pickle whose ``__reduce__`` calls ``os.system`` (here: it
creates a marker file). Before the fix each entry point below ran it (the marker appeared):
``convert inspect`` and ``convert megatron-to-hf`` (``.metadata``), ``init_checkpoint``/teacher loads
(``.metadata``; an ``_extra_state`` object in a ``.distcp`` data file, unpickled by torch's default
load planner with ``weights_only=False``), resume (the optimizer's ``.metadata``; its ``common.pt``
when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set). Now each gives an error naming the file and the
marker never appears. Legit checkpoints keep loading (the existing convert and resume tests).
"""

import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import MoEConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
OPTIM = OptimizerConfig(lr=1e-2)


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _save_worker(root: str) -> None:
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import save_training_checkpoint

    initialize_model_parallel(ParallelConfig(), seed=5)
    save_training_checkpoint(root, 1, build_policy(MODEL, ParallelConfig(), OPTIM, total_steps=2), {}, 1)


@pytest.fixture(scope="module")
def legit(tmp_path_factory) -> str:
    """A training checkpoint (weights/, optim/, rng/, state.json) written by our code."""
    root = str(tmp_path_factory.mktemp("legit"))
    run_distributed(_save_worker, 1, root)
    return os.path.join(root, "step_00000001")


def _copy(legit: str, tmp_path) -> str:
    out = str(tmp_path / "ckpt")
    shutil.copytree(legit, out)
    return out


def _poison_metadata(dist_dir: str, marker: str) -> str:
    """Embed the payload in an otherwise valid DCP ``.metadata`` (a field nothing reads); returns its path."""
    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # our own legit file
    meta.planner_data = {"note": _Payload(marker)}
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return path


def _te_format(obj) -> torch.Tensor:
    """``obj`` as Transformer Engine stores its FP8 state: a uint8 tensor of ``pickle.dumps(obj)``."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _poison_extra_state(dist_dir: str, marker: str, te_format: bool = False) -> str:
    """Point one ``_extra_state`` object of a weights checkpoint at a data file holding the payload
    (``te_format``: as a plain uint8 tensor that TE's ``set_extra_state`` would ``pickle.loads``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)
    key = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    hostile = os.path.join(dist_dir, "__hostile.distcp")
    # Megatron stores an object as the list of its shards' data.
    torch.save([_te_format({"scale_fwd": _Payload(marker)})] if te_format else _Payload(marker), hostile)
    (index,) = [i for i in meta.storage_data if i.fqn == key]
    meta.storage_data[index] = type(meta.storage_data[index])("__hostile.distcp", 0, os.path.getsize(hostile))
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return hostile


def _poison_tensor_chunk(dist_dir: str, marker: str) -> str:
    """Point the stored chunk of the embedding at a data file holding the payload (DCP reads tensor
    chunks with ``torch.load(weights_only=True)``: refused there, but as a raw ``CheckpointException``)."""
    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)
    hostile = os.path.join(dist_dir, "__hostile.distcp")
    torch.save(_Payload(marker), hostile)
    for index in [i for i in meta.storage_data if i.fqn == "embedding.word_embeddings.weight"]:
        meta.storage_data[index] = type(meta.storage_data[index])("__hostile.distcp", 0, os.path.getsize(hostile))
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return dist_dir


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m megatron_cascade.convert ...`` in its own process (conversion sets up Megatron's CPU mode)."""
    return subprocess.run([sys.executable, "-m", "megatron_cascade.convert", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("command,poison", [("inspect", _poison_metadata), ("megatron-to-hf", _poison_metadata),
                                            ("megatron-to-hf", _poison_tensor_chunk)])
def test_convert_refuses_a_hostile_file(tmp_path, legit, command, poison):
    weights = os.path.join(_copy(legit, tmp_path), "weights")
    marker = str(tmp_path / "pwned")
    path = poison(weights, marker)
    args = [weights] if command == "inspect" else ["--ckpt", weights, "--out", str(tmp_path / "hf")]
    run = _cli(command, *args)
    assert not os.path.exists(marker), "the payload ran"
    assert run.returncode == 2 and path in run.stderr and "posix.system" in run.stderr, run.stderr
    # One line (after Megatron's import warnings), no traceback.
    assert run.stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in run.stderr, run.stderr


def _load_worker(cases: list[tuple[str, str, str]]) -> dict[str, str]:
    """{case: error text} after each load ``(case, kind, path)``; kind: init | teacher | resume."""
    from megatron_cascade.stages.teachers import TeacherPool
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint
    from megatron_cascade.training.policy import load_policy_weights

    initialize_model_parallel(ParallelConfig(), seed=5)
    out = {}
    for case, kind, path in cases:
        env = "force_no_weights_only" in case
        if env:
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            if kind == "teacher":
                TeacherPool({"math": path}, MODEL, ParallelConfig(), "fingerprint")
            else:
                policy = build_policy(MODEL, ParallelConfig(), OPTIM, total_steps=2)
                if kind == "init":
                    load_policy_weights(policy, path)
                else:
                    load_training_checkpoint(path, policy)
            out[case] = "loaded"
        except Exception as exc:  # noqa: BLE001 - the test inspects the message
            out[case] = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    return out


def test_init_teacher_and_resume_refuse_hostile_files(tmp_path, legit):
    cases, expect = [], {}

    def add(case: str, kind: str, poison, sub: str) -> None:
        ckpt = _copy(legit, tmp_path / case)
        marker = str(tmp_path / f"{case}.pwned")
        expect[case] = (poison(os.path.join(ckpt, sub), marker), marker)
        cases.append((case, kind, ckpt if kind == "resume" else os.path.join(ckpt, "weights")))

    def common_pt(dist_dir: str, marker: str) -> str:
        path = os.path.join(dist_dir, "common.pt")
        torch.save({"payload": _Payload(marker)}, path)
        return path

    add("init_metadata", "init", _poison_metadata, "weights")
    add("init_extra_state", "init", _poison_extra_state, "weights")
    add("init_extra_state_te_format", "init", lambda d, m: _poison_extra_state(d, m, te_format=True), "weights")
    add("init_tensor_chunk", "init", _poison_tensor_chunk, "weights")
    add("teacher_metadata", "teacher", _poison_metadata, "weights")
    add("teacher_extra_state", "teacher", _poison_extra_state, "weights")
    add("resume_optim_metadata", "resume", _poison_metadata, "optim")
    add("resume_optim_common_force_no_weights_only", "resume", common_pt, "optim")

    def rng_pt(rng_dir: str, marker: str) -> str:  # before: refused with torch's raw traceback
        path = os.path.join(rng_dir, "rank_00000.pt")
        torch.save({"cpu": _Payload(marker)}, path)
        return path

    add("resume_rng_force_no_weights_only", "resume", rng_pt, "rng")
    messages = run_distributed(_load_worker, 1, cases)[0]
    for case, (path, marker) in expect.items():
        assert not os.path.exists(marker), f"{case}: the payload ran ({messages[case]})"
        assert messages[case].startswith("CheckpointError"), f"{case}: {messages[case]}"
        named = os.path.dirname(path) if case.endswith("te_format") else path  # the key in the weights dir
        assert named in messages[case] and "posix.system" in messages[case], f"{case}: {messages[case]}"


def test_te_extra_state_is_checked_before_set_extra_state_unpickles_it(tmp_path):
    """TE's FP8 state (recipe aside, which needs TE) passes; a payload in it, or in the older BytesIO
    format, is refused naming the key, and nothing runs."""
    import io

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError
    from megatron_cascade.checkpoint_safety.extra_state import check_extra_states

    fp8_state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3), "scale_bwd": torch.ones(2),
                 "amax_history_bwd": torch.zeros(16, 2), "extra_fp8_variables": {"num_gemms": 1, "fp8_dtype": "e4m3",
                                                                                 "dims": (1, 2), "ids": [3]}}
    check_extra_states({"layer.linear._extra_state": _te_format(fp8_state), "layer.weight": torch.ones(2),
                        "norm._extra_state": torch.empty(0), "other._extra_state": None}, "ckpt")
    marker = str(tmp_path / "pwned")
    buffer = io.BytesIO()
    torch.save({"scale_fwd": _Payload(marker)}, buffer)
    for hostile in (_te_format({"scale_fwd": _Payload(marker)}), buffer):
        with pytest.raises(UnsafeCheckpointError, match=r"ckpt: layer\.linear\._extra_state .*posix\.system"):
            check_extra_states({"layer.linear._extra_state": hostile}, "ckpt")
        with pytest.raises(UnsafeCheckpointError, match=r"ckpt: module\.layer\.linear\._extra_state .*posix"):
            check_extra_states({"module": {"layer.linear._extra_state": hostile}}, "ckpt")
    assert not os.path.exists(marker)


def _module_class(module, name: str) -> type:
    """A plain class registered as ``module.name`` (what that class is where Transformer Engine is installed)."""
    return type(name, (), {"__module__": module.__name__, "__qualname__": name})


def test_fp8_delayed_scaling_state_of_megatron_core_loads(monkeypatch):
    """Before: every FP8 checkpoint of the delayed recipe was refused on load (resume, the next stage's
    warm start, MOPD teachers): TE pickles the recipe object into each module's _extra_state, and
    megatron-core's is its own subclass TEDelayedScaling, outside TE's recipe module. Exactly that
    class is allowed; the module's other classes stay refused. (Without TE megatron-core's class is a
    mock; a plain class under its module and name stands in, as pickle finds it by those.)"""
    from megatron.core.extensions import transformer_engine as mte

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError
    from megatron_cascade.checkpoint_safety.extra_state import check_extra_states

    for name in ("TEDelayedScaling", "TELinear"):
        monkeypatch.setattr(mte, name, _module_class(mte, name))
    recipe = mte.TEDelayedScaling()
    recipe.__dict__.update(margin=0, amax_history_len=1024, amax_compute_algo="max", fp8_dpa=False)
    state = {"recipe": recipe, "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(1024, 3)}
    check_extra_states({"decoder.layers.0.mlp.linear_fc1._extra_state": _te_format(state)}, "ckpt")
    with pytest.raises(UnsafeCheckpointError, match="ckpt: layer._extra_state .*TELinear"):
        check_extra_states({"layer._extra_state": _te_format({"recipe": mte.TELinear()})}, "ckpt")


def _forged_metadata(tmp_path, **storage) -> str:
    """A one-tensor DCP ``.metadata`` (tensor 'w' [4] f32 in ``data.distcp``) with ``storage`` overriding
    the storage entry's fields (relative_path, offset, length) or, with ``chunk``, the chunk's offset."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    directory = tmp_path / "forged"
    directory.mkdir()
    (directory / "data.distcp").write_bytes(b"\0" * 64)
    offset = torch.Size([storage.pop("chunk", 0)])
    chunk = ChunkStorageMetadata(offsets=offset, sizes=torch.Size([4]))
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])
    info = {"relative_path": "data.distcp", "offset": 0, "length": 64, **storage}
    meta = Metadata({"w": entry}, storage_data={MetadataIndex("w", offset): _StorageInfo(**info)})
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return str(directory)


@pytest.mark.parametrize("forgery,fragment", [
    ({"relative_path": "../../etc/passwd"}, "data file '../../etc/passwd' is not a plain file name"),
    ({"relative_path": "/etc/passwd"}, "data file '/etc/passwd' is not a plain file name"),
    ({"offset": -8}, "span offset=-8 length=64 is not two non-negative ints"),
    ({"length": 64 << 30}, "is truncated or forged: w is said to span bytes [0, 68719476736), the file has 64"),
    ({"relative_path": "gone.distcp"}, "data file gone.distcp (of w) is missing"),
    ({"chunk": 2}, "chunk at [2] of [4] outside the tensor [4]"),
])
def test_forged_dcp_metadata_is_refused_before_any_read(tmp_path, forgery, fragment):
    """Spans and file names of a ``.metadata`` are checked before DCP reads (and sizes a buffer from) them."""
    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, check_data_spans, read_dcp_metadata

    directory = _forged_metadata(tmp_path, **forgery)
    with pytest.raises(UnsafeCheckpointError) as err:
        check_data_spans(directory, read_dcp_metadata(directory))
    assert fragment in str(err.value) and directory in str(err.value), str(err.value)


def test_valid_dcp_metadata_passes(tmp_path):
    from megatron_cascade.checkpoint_safety import check_data_spans, read_dcp_metadata

    directory = _forged_metadata(tmp_path)
    check_data_spans(directory, read_dcp_metadata(directory))


def test_forged_length_inside_a_pickle_allocates_nothing(tmp_path):
    """A BINBYTES8 opcode claiming 64 GiB: the C unpickler would allocate it before reading."""
    import struct

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 64 << 30) + b"xx.")
    with pytest.raises(UnsafeCheckpointError, match="not a readable checkpoint pickle") as err:
        read_dcp_metadata(str(tmp_path))
    # Refused by the length check (not a MemoryError, nor "truncated" after a 64 GiB allocation).
    assert "expected 68719476736 bytes" in str(err.value), str(err.value)


def test_metadata_object_without_its_fields_is_refused(tmp_path):
    """An allowed class unpickled without its fields (NEWOBJ, no BUILD) is an error naming the file."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, read_dcp_metadata

    hollow = TensorStorageMetadata.__new__(TensorStorageMetadata)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({"w": hollow})))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: invalid checkpoint metadata \(AttributeError"):
        read_dcp_metadata(str(tmp_path))


class _Python3112Pickler(pickle.Pickler):
    """Pickles Enum members as Python 3.11.0-3.11.4 does (Debian 12's 3.11.2): ``getattr(cls, name)``."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps_3112(obj, protocol) -> bytes:
    buffer = io.BytesIO()
    _Python3112Pickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()


@pytest.mark.parametrize("protocol", [2, 4])  # ``__builtin__ getattr`` (GLOBAL) and ``builtins getattr``
def test_metadata_pickled_by_python_3_11_2_loads(tmp_path, protocol):
    """Enum members in a .metadata (tensor memory formats, save-plan item types) as 3.11.2 pickles them."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from megatron_cascade.checkpoint_safety import check_data_spans, read_dcp_metadata

    directory = _forged_metadata(tmp_path)
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    plan = SavePlan([WriteItem(index=next(iter(meta.storage_data)), type=WriteItemType.TENSOR)])
    meta.storage_meta = None
    meta.planner_data = {"all_local_plans": [plan]}
    data = _dumps_3112(meta, protocol)
    assert b"getattr" in data and b"_MEM_FORMAT_ENCODING" in data and b"WriteItemType" in data
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(data)
    loaded = read_dcp_metadata(directory)
    check_data_spans(directory, loaded)
    props = loaded.state_dict_metadata["w"].properties
    assert props.memory_format is torch.contiguous_format  # decoded from _MEM_FORMAT_ENCODING's member
    assert loaded.planner_data["all_local_plans"][0].items[0].type is WriteItemType.TENSOR
    assert _MEM_FORMAT_ENCODING  # the Enum the form names


@pytest.mark.parametrize("target,name", [
    ("torch.distributed.checkpoint.planner WriteItemType", "__class__"),  # the Enum's metaclass
    ("torch.distributed.checkpoint.planner WriteItemType", "_value2member_map_"),
    ("torch.distributed.checkpoint.planner SavePlan", "__init__"),  # an allowed class that is not an Enum
    ("torch Size", "__new__"),
])
def test_getattr_in_a_pickle_reaches_only_enum_members(tmp_path, target, name):
    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, read_dcp_metadata

    module, cls = target.split()
    data = (b"\x80\x02c__builtin__\ngetattr\nc" + module.encode() + b"\n" + cls.encode() + b"\nX"
            + len(name).to_bytes(4, "little") + name.encode() + b"\x86R.")
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=r"only a member of an allowed Enum"):
        read_dcp_metadata(str(tmp_path))


def test_a_metadata_of_countless_tiny_chunks_is_refused_before_any_read(tmp_path):
    """Red team (issue 29): an allow-listed ``.metadata`` splitting tensors into 1-element chunks made
    every loader read and ``torch.load`` each one (7 s per MiB of metadata: hours at the old 1 GiB cap).
    Now a checkpoint may have at most ``MAX_CHUNKS`` tensor chunks in all, and the file at most 256 MiB."""
    import time

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, read_dcp_metadata
    from megatron_cascade.checkpoint_safety.dcp_metadata import MAX_CHUNKS, MAX_METADATA_BYTES

    n = MAX_CHUNKS + 1
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))  # one object: a small pickle
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n]), [chunk] * n)
    storage = {MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 4)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({"w": entry}, storage_data=storage)))
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match=f"{n} tensor chunks, more than the {MAX_CHUNKS}"):
        read_dcp_metadata(str(tmp_path))
    assert time.perf_counter() - start < 30  # ~1 s here; the load it prevents took ~12 s per 1,000 chunks
    with open(tmp_path / ".metadata", "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: refused by its size, never read
    with pytest.raises(UnsafeCheckpointError, match=f"more than the {MAX_METADATA_BYTES} a metadata file may have"):
        read_dcp_metadata(str(tmp_path))


DEEP_MOE = ModelConfig(num_layers=12, hidden_size=32, num_attention_heads=2, vocab_size=100, ffn_hidden_size=64,
                       moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=16))


def _deep_moe_round_trip(root: str) -> float:
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights, save_model_weights

    initialize_model_parallel(ParallelConfig(), seed=3)
    saved = build_gpt_model(DEEP_MOE, ParallelConfig())
    save_model_weights(saved, root, DEEP_MOE)
    loaded = build_gpt_model(DEEP_MOE, ParallelConfig())
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    load_model_weights(loaded, root, DEEP_MOE)
    return max((a - b).abs().max().item() for a, b in zip(saved.state_dict().values(), loaded.state_dict().values())
               if isinstance(a, torch.Tensor) and a.is_floating_point())


def test_a_deep_moe_checkpoint_of_one_rank_loads(tmp_path):
    """Megatron stacks layers and local experts into one tensor per weight: a 12-layer, 8-expert model
    on one rank writes 192 chunks of each expert weight into one file. The first metadata bound (8 per
    tensor per file) refused every model of more than 8 layers, our own checkpoints included (seen)."""
    assert run_distributed(_deep_moe_round_trip, 1, str(tmp_path / "w"))[0] == 0.0

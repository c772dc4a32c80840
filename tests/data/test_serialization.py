import collections
import pickle

import numpy as np
import pytest
import torch

from bagua.data.serialization import CorruptValueError, SerializationError, UntrustedValueError, dumps, loads
from tests.data.samples import Unpicklable, make_sample, same
from tests.payloads import RunsCodeWhenUnpickled

Point = collections.namedtuple("Point", "x y")

VALUES = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.random.default_rng(0).standard_normal((5, 3))),
    np.arange(20)[::3],  # non-contiguous
    np.array([np.nan, -0.0, np.inf]),
    np.zeros((0, 7), dtype=np.int16),
    np.array(["ab", "c"]),
    np.arange(3).astype("datetime64[ns]"),
    np.zeros(3, dtype=[("a", "<i4"), ("b", ">f8")]),
    np.array([1, None, "x"], dtype=object),
    np.float32(2.5),
    torch.randn(2, 3, 4),
    torch.randn(4, 3).t(),  # non-contiguous
    torch.randn(5, dtype=torch.bfloat16),
    torch.tensor([True, False]),
    torch.tensor(7, dtype=torch.int64),
    torch.empty(0, 3),
    torch.randn(3, dtype=torch.complex64),
    torch.randn(3, requires_grad=True),
    torch.randn(3).to(torch.float8_e4m3fn),
    torch.nn.Parameter(torch.randn(2)),
    make_sample(7),
    [1, 2.5, "three", b"four", None, (5,)],
    {"img": torch.ones(2, 2), "label": 3, "nested": {"arr": np.ones(3)}},
    collections.OrderedDict(a=np.ones(2), b=collections.deque([1 + 2j, {3, 4}, frozenset([5])])),
    collections.defaultdict(list, {"x": [torch.tensor(1), np.int64(2), np.dtype("<f2"), torch.Size([2])]}),
    (slice(1, 5, 2), range(3), torch.device("cpu"), torch.float16),
    bytearray(b"xyz"),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_roundtrip_keeps_types_and_bits(value):
    out = loads(dumps(value))
    if isinstance(value, torch.nn.Parameter):
        assert type(out) is torch.nn.Parameter and torch.equal(out, value)
    elif isinstance(value, np.ndarray) and value.dtype.hasobject:
        assert type(out) is np.ndarray and out.tolist() == value.tolist()
    elif type(value) is torch.Tensor and value.dtype == torch.float8_e4m3fn:
        assert out.dtype == value.dtype and torch.equal(out.view(torch.uint8), value.view(torch.uint8))
    else:
        assert same(out, value), (value, out)


def test_a_value_naming_other_code_is_refused_unless_trusted(tmp_path):
    marker = tmp_path / "marker"
    refused = r"names tests\.payloads\.write_marker, .*trust_pickled_values=True"
    with pytest.raises(UntrustedValueError, match="sample 7 " + refused):
        dumps(RunsCodeWhenUnpickled(marker), describe=lambda: "sample 7")  # refused when first cached too
    hostile = dumps(RunsCodeWhenUnpickled(marker), trust_pickled=True)  # as anyone who can write to the store could
    with pytest.raises(UntrustedValueError, match=refused):
        loads(hostile)
    assert not marker.exists()
    assert loads(hostile, trust_pickled=True) == str(marker) and marker.exists()

    point = Point(np.ones(2), torch.zeros(1))  # a class of the user's: trusted only when asked
    with pytest.raises(UntrustedValueError, match=r"tests\.data\.test_serialization\.Point"):
        loads(dumps(point, trust_pickled=True))
    back = loads(dumps(point, trust_pickled=True), trust_pickled=True)
    assert type(back) is Point and back._fields == ("x", "y")  # the user's class, not a bare tuple
    assert same(back.x, point.x) and same(back.y, point.y)


class _TensorOfNoDtype:
    def __reduce__(self):  # bagua's own rebuild function, asked for torch.load as the "dtype"
        from bagua.data.serialization import _rebuild_tensor
        return _rebuild_tensor, (b"", "load", (0,), False)


def test_a_rebuild_function_takes_only_what_it_rebuilds():
    with pytest.raises(CorruptValueError, match="'load' is not a torch dtype"):
        loads(dumps(_TensorOfNoDtype()))


def test_decoded_arrays_and_tensors_are_writable_and_own_their_memory():
    a, t = np.arange(6.0), torch.arange(6.0)
    data = bytearray(dumps((a, t)))
    a2, t2 = loads(memoryview(data))
    data[:] = b"\0" * len(data)  # the source buffer goes away (as an LMDB page may)
    assert a2.flags.writeable and a2.tolist() == a.tolist()
    assert t2.tolist() == t.tolist()
    a2[0], t2[0] = 100, 100  # writable without warnings
    for single in (np.arange(4.0), torch.arange(4.0)):
        buf = bytearray(dumps(single))
        out = loads(memoryview(buf))
        buf[:] = b"\0" * len(buf)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_arrays_travel_as_raw_bytes_not_per_element_pickles():
    a = np.random.default_rng(0).standard_normal(100_000)
    t = torch.randn(100_000)
    assert len(dumps(a)) < a.nbytes + 100
    assert len(dumps(t)) < t.numel() * 4 + 100
    both = dumps((t, a, {"label": 3}))
    assert len(both) < a.nbytes + t.numel() * 4 + 400


def test_unpicklable_sample_names_its_type():
    with pytest.raises(SerializationError, match=r"index 9 of dataset 'x'.*tests\.data\.samples\.Unpicklable"):
        dumps(Unpicklable(), describe=lambda: "the sample at index 9 of dataset 'x'")
    with pytest.raises(SerializationError, match="tuple"):
        dumps((1, lambda: 2), trust_pickled=True)


@pytest.mark.parametrize("value", [np.arange(40.0), make_sample(3)], ids=["array", "tuple"])
def test_every_truncation_and_every_flipped_byte_is_detected(value):
    data = dumps(value)
    for n in range(len(data)):
        with pytest.raises(CorruptValueError):
            loads(data[:n])
    with pytest.raises(CorruptValueError):
        loads(data + b"\0")
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptValueError):
            loads(bytes(bad))


def test_foreign_bytes_are_rejected():
    with pytest.raises(CorruptValueError, match="magic"):
        loads(pickle.dumps(np.arange(3)))
    with pytest.raises(CorruptValueError, match="too short"):
        loads(b"")

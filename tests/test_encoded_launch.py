"""The two-step Gluon launch on the host (moe_lib/encoded_launch.py): descriptors, caching, argument encoding.

The launch itself needs a Hopper GPU (test_gpu_gluon_* in tests/swiglu_down/test_designs.py); here the host logic
runs against stand-ins for the compiled kernel and Triton's launcher.
"""

import pytest
import torch

from moe_lib import encoded_launch
from moe_lib.encoded_launch import EncodedLaunch, descriptor, prepared_launch, shared_layout


def test_descriptor_of_a_tensor_in_its_blocks_with_one_layout_per_block_and_dtype():
    x = torch.empty((300, 256), dtype=torch.bfloat16)
    desc = descriptor(x, (64, 128))
    assert list(desc.shape) == [300, 256] and list(desc.strides) == [256, 1] and list(desc.block_shape) == [64, 128]
    assert desc.base is x
    assert descriptor(torch.empty((8, 64), dtype=torch.bfloat16), (64, 128)).layout is desc.layout  # cached
    assert descriptor(torch.empty((8, 64), dtype=torch.float16), (64, 128)).layout is not desc.layout
    assert shared_layout((64, 128), encoded_launch.gl.bfloat16) is desc.layout


def test_descriptor_refuses_a_dtype_the_gluon_launches_do_not_take():
    with pytest.raises(ValueError, match="tensor: the Gluon launches take bf16 or fp16 operands, not torch.float32"):
        descriptor(torch.empty((8, 64), dtype=torch.float32), (8, 64))


class StandInKernel:
    """``kernel[grid](*arguments, **options)`` as Triton's JIT takes it: records each call, returns a stand-in
    compiled kernel."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*arguments, **options):
            self.calls.append((grid, arguments, options))
            return "compiled"

        return run


class StandInEncodedLaunch:
    """EncodedLaunch's interface: what it encoded, what it launched."""

    def __init__(self, compiled):
        assert compiled == "compiled"
        self.launches = []

    def encode(self, *arguments):
        return ["encoded", *arguments]

    def launch(self, programs, arguments, stream):
        self.launches.append((programs, arguments, stream))


def test_prepared_launch_compiles_through_the_jit_once_then_launches_encoded_arguments(monkeypatch):
    monkeypatch.setattr(encoded_launch, "EncodedLaunch", StandInEncodedLaunch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 7})())
    kernel, cache = StandInKernel(), {}
    first = prepared_launch(cache, "key", kernel, 12, ("a", 3), warps=8, maxnreg=168, device="cuda")
    assert not kernel.calls and not cache  # nothing runs until the callable is called
    first()
    assert kernel.calls == [((12,), ("a", 3), dict(num_warps=8, maxnreg=168))]
    encoded = cache["key"]
    later = prepared_launch(cache, "key", kernel, 5, ("b", 4), warps=8, maxnreg=168, device="cuda")
    assert not encoded.launches  # encoded now, launched only when called
    later()
    assert encoded.launches == [(5, ["encoded", "b", 4, 8], 7)]  # num_warps appended, the stream's handle
    later(9)  # on another stream (a side stream being captured)
    assert encoded.launches[-1][2] == 9
    assert later.compiled and not hasattr(first, "compiled")  # only a compiled kernel's launch can be captured
    assert len(kernel.calls) == 1  # no second pass through the JIT
    prepared_launch(cache, "other key", kernel, 5, ("b", 4), warps=8, maxnreg=168, device="cuda")()
    assert len(kernel.calls) == 2 and set(cache) == {"key", "other key"}


def test_encode_expands_each_descriptor_with_its_metadata_and_passes_the_rest(monkeypatch):
    launch = object.__new__(EncodedLaunch)  # its launcher and encoder replaced by stand-ins
    launch.descriptor_metadata = ["meta0", "meta1"]
    launch.encode_descriptor = lambda desc, meta: [f"map({desc.block_shape[0]},{meta})", *desc.shape]
    x = torch.empty((40, 64), dtype=torch.bfloat16)
    first, second = descriptor(x, (8, 64)), descriptor(x, (16, 64))
    assert launch.encode(first, x, 3, second, True) == ["map(8,meta0)", 40, 64, x, 3, "map(16,meta1)", 40, 64, True]
    with pytest.raises(ValueError, match="arguments: 1 descriptors, the kernel takes 2"):
        launch.encode(first, x, 3)
    with pytest.raises(ValueError, match="arguments: 3 descriptors, the kernel takes 2"):
        launch.encode(first, second, first)


class StandInDriver:
    """The libcuda functions :func:`launch_as_one_graph` calls, recording them; graphs and executables are ints."""

    def __init__(self, update_result=0):
        self.calls, self.update_result, self.next_handle = [], update_result, 100

    def _handle(self, out):
        self.next_handle += 1
        out._obj.value = self.next_handle
        return self.next_handle

    def cuStreamBeginCapture_v2(self, stream, mode):
        self.calls.append(("begin", stream.value, mode))
        return 0

    def cuStreamEndCapture(self, stream, graph):
        self.calls.append(("end", stream.value, self._handle(graph)))
        return 0

    def cuGraphInstantiateWithFlags(self, executable, graph, flags):
        self.calls.append(("instantiate", graph.value, self._handle(executable)))
        return 0

    def cuGraphExecUpdate_v2(self, executable, graph, info):
        self.calls.append(("update", executable.value, graph.value))
        return self.update_result

    def cuGraphLaunch(self, executable, stream):
        self.calls.append(("launch", executable.value, stream.value))
        return 0

    def cuGraphDestroy(self, graph):
        self.calls.append(("destroy graph", graph.value))
        return 0

    def cuGraphExecDestroy(self, executable):
        self.calls.append(("destroy executable", executable.value))
        return 0


@pytest.fixture
def stand_in_driver(monkeypatch):
    driver = StandInDriver()
    monkeypatch.setattr(encoded_launch, "cuda_driver_api", lambda: driver)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: type("Stream", (), {"cuda_stream": 5})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 7})())
    monkeypatch.setattr(encoded_launch, "GRAPH_EXECS", encoded_launch.collections.OrderedDict())
    monkeypatch.setattr(encoded_launch, "_SIDE_STREAMS", {})
    return driver


def test_launch_as_one_graph_captures_on_a_side_stream_then_updates_one_kept_executable(stand_in_driver):
    launched = []
    launches = (
        lambda stream: launched.append(("launch 1", stream)),
        lambda stream: launched.append(("launch 2", stream)),
    )
    encoded_launch.launch_as_one_graph("key", launches, "cuda:0")
    assert launched == [("launch 1", 5), ("launch 2", 5)]  # captured on the side stream, in order
    assert stand_in_driver.calls == [
        ("begin", 5, encoded_launch.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        ("end", 5, 101),
        ("instantiate", 101, 102),
        ("launch", 102, 7),
        ("destroy graph", 101),
    ]  # launched on the caller's stream
    stand_in_driver.calls.clear()
    encoded_launch.launch_as_one_graph("key", launches, "cuda:0")  # the same key: the kept executable, updated
    assert stand_in_driver.calls[2:] == [("update", 102, 103), ("launch", 102, 7), ("destroy graph", 103)]
    stand_in_driver.update_result = 1  # an update the driver refuses: instantiated anew, the old one destroyed
    stand_in_driver.calls.clear()
    encoded_launch.launch_as_one_graph("key", launches, "cuda:0")
    assert stand_in_driver.calls[2:] == [
        ("update", 102, 104),
        ("destroy executable", 102),
        ("instantiate", 104, 105),
        ("launch", 105, 7),
        ("destroy graph", 104),
    ]


def test_launch_as_one_graph_keeps_a_bounded_number_of_executables(stand_in_driver, monkeypatch):
    monkeypatch.setattr(encoded_launch, "GRAPH_EXECS_KEPT", 2)
    for key in ("a", "b", "c"):
        encoded_launch.launch_as_one_graph(key, (lambda stream: None,), "cuda:0")
    assert list(encoded_launch.GRAPH_EXECS) == ["b", "c"]
    assert ("destroy executable", 102) in stand_in_driver.calls  # "a"'s, the oldest


def test_launch_as_one_graph_ends_the_capture_when_a_launch_fails(stand_in_driver):
    def failing(stream):
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        encoded_launch.launch_as_one_graph("key", (failing,), "cuda:0")
    assert [call[0] for call in stand_in_driver.calls] == ["begin", "end"]  # the side stream no longer capturing
    assert not encoded_launch.GRAPH_EXECS


def test_one_graph_available_warns_once_where_the_driver_lacks_graph_updates(monkeypatch):
    def missing():
        raise AttributeError("libcuda.so.1: undefined symbol: cuGraphExecUpdate_v2")

    monkeypatch.setattr(encoded_launch, "cuda_driver_api", missing)
    encoded_launch.one_graph_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="cannot update graphs .*undefined symbol: cuGraphExecUpdate_v2"):
            assert not encoded_launch.one_graph_available()
        assert not encoded_launch.one_graph_available()  # decided once: no second warning
    finally:
        encoded_launch.one_graph_available.cache_clear()


def test_launch_as_one_graph_captures_on_one_side_stream_per_thread(stand_in_driver, monkeypatch):
    import threading

    streams = iter((5, 6))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: type("Stream", (), {"cuda_stream": next(streams)})())
    seen = []
    launch = (lambda stream: seen.append(stream),)
    encoded_launch.launch_as_one_graph("key", launch, "cuda:0")
    worker = threading.Thread(target=encoded_launch.launch_as_one_graph, args=("key", launch, "cuda:0"))
    worker.start()
    worker.join()
    encoded_launch.launch_as_one_graph("key", launch, "cuda:0")
    assert seen == [5, 6, 5]  # a capture never meets another thread's on the same stream


def test_can_launch_as_one_graph_only_compiled_launches_outside_a_capture_with_a_driver_that_updates(monkeypatch):
    def compiled(stream=None):
        pass

    compiled.compiled = True
    capturing, available = [False], [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(encoded_launch, "one_graph_available", lambda: available[0])
    assert encoded_launch.can_launch_as_one_graph((compiled, compiled))
    assert not encoded_launch.can_launch_as_one_graph((compiled, lambda: None))  # a first call: it compiles
    capturing[0] = True
    assert not encoded_launch.can_launch_as_one_graph((compiled, compiled))  # the caller's capture takes them
    capturing[0], available[0] = False, False
    assert not encoded_launch.can_launch_as_one_graph((compiled, compiled))

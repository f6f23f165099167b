"""The two-step Gluon launch on the host (moe_lib/encoded_launch.py): descriptors, caching, argument encoding, the
global scratch, the compile key of a kernel's kept launches.

The launch itself needs a Hopper GPU (test_gpu_gluon_* in tests/swiglu_down/test_designs.py, the grouped engine's in
tests/engine/test_encoded_launches.py); here the host logic runs against stand-ins for the compiled kernel and
Triton's launcher.
"""

import contextvars
import itertools
from types import SimpleNamespace

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_lib import encoded_launch
from moe_lib.encoded_launch import (
    EncodedLaunch,
    KernelLaunches,
    descriptor,
    prepared_launch,
    shared_layout,
    specialization,
)


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


def test_encode_encodes_a_descriptor_given_for_several_arguments_once():
    launch = object.__new__(EncodedLaunch)
    launch.descriptor_metadata = ["meta0", "meta0", "meta1"]
    encoded = []

    def encode_descriptor(desc, meta):
        encoded.append(meta)
        return [f"map({meta})"]

    launch.encode_descriptor = encode_descriptor
    x = torch.empty((40, 64), dtype=torch.bfloat16)
    desc = descriptor(x, (8, 64))
    assert launch.encode(desc, desc, desc) == ["map(meta0)", "map(meta0)", "map(meta1)"]
    assert encoded == ["meta0", "meta1"]  # once per descriptor and metadata
    assert launch.encode(desc, descriptor(x, (8, 64)), desc) == ["map(meta0)", "map(meta0)", "map(meta1)"]
    assert encoded == ["meta0", "meta1", "meta0", "meta0", "meta1"]  # another object for the same tensor: its own


def launch_with_scratch(scratch_bytes, *, ctas=1):
    """An EncodedLaunch whose kernel needs ``scratch_bytes`` of global scratch a program; its launcher records its
    arguments."""
    launch = object.__new__(EncodedLaunch)
    launch.scratch_bytes, launch.scratch_align, launch.ctas = scratch_bytes, 128, ctas
    launch.function, launch.packed_metadata, launch.cooperative, launch.pdl = "function", (8, 1, 0), False, False
    launch.calls = []
    launch.c_launch = lambda *arguments: launch.calls.append(arguments)
    return launch


def test_launch_allocates_the_global_scratch_as_tritons_launcher_does():
    """programs × CTAs × the compiled size at its alignment, from triton.set_allocator's allocator, on the launch's
    stream, handed to the launcher in its global-scratch slot; no allocation where the kernel needs none."""
    asked = []

    def allocator(size, alignment, stream):
        asked.append((size, alignment, stream))
        return f"buffer of {size}"

    def run():
        triton.set_allocator(allocator)
        launch = launch_with_scratch(384)
        launch.launch(132, ["a", 3], 7)
        assert asked == [(132 * 384, 128, 7)]
        scratch_slot = (132, 1, 1, 7, "function", False, False, f"buffer of {132 * 384}", None)
        assert launch.calls == [(*scratch_slot, (8, 1, 0), None, None, None, "a", 3)]
        launch_with_scratch(384, ctas=2).launch(5, [], 9)
        assert asked[-1] == (5 * 2 * 384, 128, 9)
        without = launch_with_scratch(0)
        without.launch(132, ["a"], 7)
        assert len(asked) == 2 and without.calls[0][7] is None

    contextvars.copy_context().run(run)  # the allocator set in a context of its own, as Triton keeps it


def test_encoded_launch_refuses_a_kernel_that_needs_profile_scratch():
    handles = []
    compiled = SimpleNamespace(
        name="kernel",
        metadata=SimpleNamespace(profile_scratch_size=64, global_scratch_size=0, global_scratch_align=1),
        _init_handles=lambda: handles.append(1),
    )
    with pytest.raises(RuntimeError, match="kernel needs profile scratch memory: EncodedLaunch does not allocate"):
        EncodedLaunch(compiled)
    assert not handles  # refused before the kernel is loaded


def specialization_samples():
    """Run-time arguments of every kind the launches pass, with the values where Triton's specialisation changes."""
    bf16 = torch.empty(4096, dtype=torch.bfloat16)
    fp32 = torch.empty(1024, dtype=torch.float32)
    edges = [edge + step for edge in (2**31, -(2**31), 2**63) for step in (-16, -1, 0, 16)]  # i32, i64, u64
    integers = [0, 1, 2, 8, 15, 16, 17, 32, 48, -1, -16, *edges, 2**64 - 1]
    int32, fp16 = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.float16)
    tensors = [bf16, bf16[8:], bf16[1:], bf16[3:], fp32, fp32[4:], fp32[1:], int32, int32[1:], fp16]
    rows = bf16.view(64, 64)
    descriptors = [
        descriptor(rows, (64, 64)),
        descriptor(rows[:32], (64, 64)),
        descriptor(rows, (32, 64)),
        descriptor(rows, (64, 32)),
        descriptor(torch.empty(64, 64, dtype=torch.float16), (64, 64)),
        TensorDescriptor.from_tensor(fp32.view(32, 32), [32, 32], shared_layout((32, 32), encoded_launch.gl.float32)),
        descriptor(torch.empty(2, 64, 64, dtype=torch.bfloat16), (1, 64, 64)),
    ]
    return integers + tensors + descriptors + [True, False, 0.5, 2.0, None]


def test_specialization_tells_apart_what_tritons_jit_compiles_apart():
    """Two arguments get the same specialization exactly where Triton's JIT specialises them alike: a key of it
    neither shares a compiled kernel between arguments the JIT compiles apart nor needlessly splits one."""
    samples = specialization_samples()

    def tritons(argument):
        return native_specialize_impl(BaseBackend, argument, False, True, True)

    for first, second in itertools.combinations(samples, 2):
        ours = specialization(first) == specialization(second)
        assert ours == (tritons(first) == tritons(second)), (first, second, tritons(first), tritons(second))
    assert len({specialization(s) for s in samples}) == len({tritons(s) for s in samples})
    for sample in samples:
        hash(specialization(sample))  # a key of them is hashable


class StandInJit:
    """A JIT-compiled kernel's interface as KernelLaunches reads it: its arguments' names and which are constexprs;
    ``kernel[grid](**arguments)`` records the call and returns a stand-in compiled kernel."""

    def __init__(self):
        self.arg_names = ["x_ptr", "n", "BLOCK", "num_warps"]
        self.params = [SimpleNamespace(is_constexpr=name.isupper() or name == "num_warps") for name in self.arg_names]
        self.calls = []

    def __getitem__(self, grid):
        def run(**arguments):
            self.calls.append((grid, arguments))
            return f"compiled {len(self.calls)}"

        return run


class StandInCompiled:
    """EncodedLaunch's interface, for the compiled kernel it wraps: what it encoded and launched."""

    def __init__(self, compiled):
        self.compiled, self.launches = compiled, []

    def encode(self, *arguments):
        return ["encoded", *arguments]

    def launch(self, programs, arguments, stream):
        self.launches.append((programs, arguments, stream))


def test_kernel_launches_compile_through_the_jit_once_per_key_then_launch_encoded(monkeypatch):
    monkeypatch.setattr(encoded_launch, "EncodedLaunch", StandInCompiled)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    kernel = StandInJit()
    launches = KernelLaunches(kernel)
    device = torch.device("cuda", 0)
    x, y = torch.empty(64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
    arguments = dict(x_ptr=x, n=32, BLOCK=64, num_warps=8)
    launches(12, arguments, maxnreg=168, device=device)
    assert kernel.calls == [((12,), dict(arguments, maxnreg=168))]  # as the JIT path calls it
    (compiled,) = launches.compiled.values()
    assert compiled.compiled == "compiled 1" and not compiled.launches
    launches(5, dict(x_ptr=y, n=48, BLOCK=64, num_warps=8), maxnreg=168, device=device)  # n: a multiple of 16 again
    assert len(kernel.calls) == 1
    assert compiled.launches == [(5, ["encoded", y, 48, 64, 8], 7)]  # the new tensor, in the kernel's order
    for changed in (
        dict(n=1),
        dict(n=33),
        dict(n=2**31),
        dict(x_ptr=x[1:]),
        dict(x_ptr=x.float()),
        dict(BLOCK=128),
        dict(num_warps=4),
    ):
        calls = len(kernel.calls)
        launches(5, arguments | changed, maxnreg=168, device=device)
        assert len(kernel.calls) == calls + 1, changed  # compiled for anew
    launches(5, arguments, maxnreg=128, device=device)
    launches(5, arguments, maxnreg=168, device=torch.device("cuda", 1))
    assert len(kernel.calls) == 10 and len(launches.compiled) == 10
    launches(3, arguments | dict(n=32 * 5), maxnreg=168, device=device)  # the first key again
    assert len(kernel.calls) == 10 and compiled.launches[-1] == (3, ["encoded", x, 160, 64, 8], 7)


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

    context = 0  # the context current on the calling thread (one for every thread: a test's threads take turns)

    def cuCtxGetCurrent(self, out):
        self.calls.append(("get context",))
        out._obj.value = self.context or None
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out, device):
        self.calls.append(("retain", device.value))
        out._obj.value = 900 + device.value
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(("set context", context.value))
        self.context = context.value
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


def test_a_thread_without_a_current_context_gets_the_primary_one_once(stand_in_driver, monkeypatch):
    """A thread with no current CUDA context (autograd's device thread before its first launch) gets its device's
    primary context before a descriptor is encoded, and asks the driver once; a thread with one keeps it."""
    import threading

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def in_a_new_thread():
        worker = threading.Thread(target=encoded_launch.context_current_on_this_thread)
        worker.start()
        worker.join()

    in_a_new_thread()
    assert stand_in_driver.calls == [("get context",), ("retain", 1), ("set context", 901)]
    stand_in_driver.calls.clear()
    in_a_new_thread()  # a context is current there already (the stand-in's is every thread's): nothing set
    assert stand_in_driver.calls == [("get context",)]
    stand_in_driver.calls.clear()
    worker = threading.Thread(target=lambda: [encoded_launch.context_current_on_this_thread() for _ in range(3)])
    worker.start()
    worker.join()
    assert stand_in_driver.calls == [("get context",)]  # asked once a thread


@pytest.mark.gpu
def test_gpu_a_new_threads_first_descriptor_encodes(seed):
    """A host TMA descriptor encoded on a thread that has launched nothing (as autograd's device thread is when a
    backward's first CUDA call is an encoding): no "invalid device context"."""
    import threading

    from triton.backends.nvidia import driver as cuda_driver

    tensor = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    # a bf16 operand's 64 × 64 block, swizzled by 128 bytes: what the kernels' launches encode
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64], "fp4_padded": False}
    errors = []

    def encode():
        try:
            encoded_launch.context_current_on_this_thread()
            cuda_driver.make_tensordesc_arg(encoded_launch.descriptor(tensor, (64, 64)), meta)
        except Exception as exc:  # reported to the test's thread
            errors.append(exc)

    worker = threading.Thread(target=encode)
    worker.start()
    worker.join()
    assert not errors, errors

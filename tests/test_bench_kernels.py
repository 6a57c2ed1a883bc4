"""The kernel benchmark runs end to end and writes well-formed results (no timing asserted)."""
import math

import pytest
import torch

from bench_utils import assert_exits_cleanly_and_prints, check_record, quick_run_fixture
from fusedreduce.bench.kernels_bench import DIRECTIONS, METHODS, ROLES, Workload, check
from fusedreduce.bench.models import (n_elements, resnet50_classes, resnet50_shapes,
                                      resnet50_shapes_for_size, resnet50_width_for_size,
                                      transformer_shapes, transformer_shapes_for_size)

# every method runs on the CPU; the quick run's lists are fp16, so the
# same-dtype split_with_sizes_copy baseline does not apply there, and its
# scale is 1/8, so torch_scale_then_foreach (scale != 1) does
CPU_METHODS = {"flatten": {"copy", "naive", "views_then_scale", "torch_foreach", "torch_cat",
                           "torch_chunk_cat",
                           "fusedreduce", "fusedreduce_prepared", "fusedreduce_fresh_out",
                           "fusedreduce_int8",
                           "fusedreduce_float8", "fusedreduce_host",
                           "fusedreduce_host_moved", "fusedreduce_host_new",
                           "fusedreduce_host_prepared"},
               "unflatten": {"copy", "naive", "scale_then_views", "torch_foreach",
                             "torch_scale_then_foreach", "fusedreduce", "fusedreduce_prepared",
                             "fusedreduce_host", "fusedreduce_host_moved",
                             "fusedreduce_host_new", "fusedreduce_host_prepared"}}
HOST_ROWS = {"fusedreduce_host", "fusedreduce_host_moved", "fusedreduce_host_new",
             "fusedreduce_host_prepared"}


quick_run = quick_run_fixture(
    "kernels", ["kernels", "--quick", "--sizes", "20K,50K", "--repeats", "2", "--device", "cpu",
                "--no-progress"], "``kernels --quick`` run on the CPU at two tiny sizes")


def test_quick_kernel_benchmark_exits_cleanly_and_prints_every_method(quick_run):
    process, _ = quick_run
    assert_exits_cleanly_and_prints(process, set().union(*CPU_METHODS.values()))


def test_quick_kernel_benchmark_records_the_machine_and_every_case(quick_run):
    _, record = quick_run
    results = check_record(record, ["kernels"])
    assert record["machine"]["device"] == "cpu"
    assert record["machine"]["kernel_backend"] == "torch"
    assert record["machine"]["dist_backend"] is None
    assert record["machine"]["torch"] == torch.__version__
    assert record["config"]["kernels"]["sizes"] == [20_000, 50_000]
    assert record["config"]["collectives"] is None
    cases = {(r["list"], r["direction"], r["size"]) for r in results}
    assert cases == {(name, direction, size) for name in ("resnet50", "transformer")
                     for direction in DIRECTIONS for size in (20_000, 50_000)}
    for list_name, direction, size in cases:
        group = [r for r in results
                 if (r["list"], r["direction"], r["size"]) == (list_name, direction, size)]
        assert {r["method"] for r in group} == CPU_METHODS[direction]
        assert all(r["baseline"] == "copy" and r["scale"] == 0.125 for r in group)
        assert all(r["role"] == ROLES[r["method"]] for r in group)
        for host in (r for r in group if r["method"] in HOST_ROWS):
            # host time only: no bandwidth, no ratio; a positive time, in µs too
            assert host["gbps"] is None and host["ratio"] is None
            assert host["time_ms"] > 0 and math.isclose(host["host_us"], host["time_ms"] * 1e3)


def test_bytes_count_one_read_and_one_write_of_every_element(quick_run):
    _, record = quick_run
    for result in record["results"]:
        if result["method"] in HOST_ROWS:
            continue  # host time: it moves no bytes of its own
        sizes = [torch.finfo(getattr(torch, result[key])).bits // 8
                 for key in ("dtype_in", "dtype_out")]
        assert result["bytes"] == result["n_elements"] * sum(sizes)
        assert "float32" in (result["dtype_in"], result["dtype_out"])


def test_full_tensor_lists_have_the_documented_sizes():
    resnet = resnet50_shapes()
    assert len(resnet) == 161
    assert n_elements(resnet) == 25_557_032
    transformer = transformer_shapes()
    assert len(transformer) == 147
    assert n_elements(transformer) == 27_585_792


@pytest.mark.parametrize("size", [20_000, 250_000, 1_000_000, 25_600_000])
def test_scaled_resnet50_has_the_width_nearest_the_size(size):
    def count(width):
        return n_elements(resnet50_shapes(width, resnet50_classes(width)))

    width = resnet50_width_for_size(size)
    shapes = resnet50_shapes_for_size(size)
    assert len(shapes) == 161 and n_elements(shapes) == count(width)
    for neighbour in (width - 1, width + 1):
        if neighbour >= 1:
            assert abs(count(width) - size) <= abs(count(neighbour) - size)


@pytest.mark.parametrize("size", [250_000, 1_000_000, 25_600_000])
def test_scaled_tensor_lists_keep_their_tensors_and_come_near_the_size(size):
    for shapes_for_size, tensors in ((resnet50_shapes_for_size, 161),
                                     (transformer_shapes_for_size, 147)):
        shapes = shapes_for_size(size)
        assert len(shapes) == tensors
        assert math.isclose(n_elements(shapes), size, rel_tol=0.15), shapes_for_size


def test_the_full_size_resnet50_list_is_torchvisions():
    assert resnet50_shapes_for_size(25_557_032) == resnet50_shapes()


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.125, 1.0])
def test_every_method_computes_the_right_result(direction, dtype, scale):
    workload = Workload("tiny", [(3, 5), (7,), (2, 2, 3)], dtype, torch.device("cpu"))
    fns = METHODS[direction](workload, scale)
    # the host-cost row is no method of its own; split_with_sizes_copy cannot cast
    expected = CPU_METHODS[direction] - HOST_ROWS
    if direction == "unflatten" and dtype == torch.float32:
        expected = expected | {"torch_split_copy"}
    if scale == 1.0:
        expected = expected - {"torch_scale_then_foreach"}
    assert set(fns) == expected
    for name, fn in fns.items():
        workload.out.fill_(float("nan"))
        for t in workload.dsts:
            t.fill_(float("nan"))
        check(workload, scale, direction, name, fn())


@pytest.mark.parametrize("address_sets, buffer_sets", [(1, 1), (2, 1), (8, 1), (1, 8)])
def test_the_host_rows_time_the_kept_launch_and_the_moved_ones_re_point_it(monkeypatch,
                                                                          address_sets,
                                                                          buffer_sets):
    from fusedreduce.bench import host_cost
    from fusedreduce.kernels import _prepared, triton_unavailable_reason
    if triton_unavailable_reason() is not None:
        pytest.skip(f"the host rows time the Triton path: {triton_unavailable_reason()}")
    tensors = [torch.ones(3, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16)]
    out = torch.zeros(7)
    own = out.data_ptr()
    dsts = [torch.zeros_like(t) for t in tensors]
    assert host_cost.NEW_SETS == 8 > _prepared.RECENT  # the "new" row's sets are never kept
    repointed, prepared, checked = [], [], []
    rebind, init = _prepared.Prepared.rebind, _prepared.Prepared.__init__
    spans_clear = _prepared.spans_clear
    monkeypatch.setattr(_prepared.Prepared, "rebind",
                        lambda self, *args: repointed.append(1) or rebind(self, *args))
    monkeypatch.setattr(_prepared, "spans_clear",
                        lambda *args: checked.append(1) or spans_clear(*args))
    monkeypatch.setattr(_prepared.Prepared, "__init__",
                        lambda self, *args, **kw: prepared.append(1) or init(self, *args, **kw))
    for direction in DIRECTIONS:
        repointed.clear(), prepared.clear(), checked.clear()
        samples = host_cost.time_host(tensors, out, dsts, direction, 0.5, calls=4,
                                      address_sets=address_sets, buffer_sets=buffer_sets)
        assert len(samples) == 4 and out.data_ptr() == own
        # one preparation; then every call of a moved row re-points it: two
        # sets in turn check their spans once (the second set's first call),
        # then switch between kept bindings; sets that are never kept check
        # them at every call (and so does a buffer given other memory at every
        # call: the launch follows it)
        calls = host_cost.WARMUP + 4
        sets = max(address_sets, buffer_sets)
        assert len(prepared) == 1, direction
        assert len(repointed) == (0 if sets == 1 else calls - 1), direction
        assert len(checked) == {1: 0, 2: 1, 8: calls - 1}[sets], direction


def test_the_result_check_rejects_a_wrong_buffer():
    workload = Workload("tiny", [(4,), (6,)], torch.float16, torch.device("cpu"))
    with pytest.raises(AssertionError, match="fusedreduce"):
        check(workload, 0.125, "flatten", "fusedreduce", workload.src.float())  # unscaled

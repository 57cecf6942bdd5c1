import itertools

import pytest

from pipeline.core import buckets, slicing

CASES = [(n, size, hosts) for n in (0, 1, 3, 7, 8, 9, 31, 64, 100, 257)
         for size in (1, 2, 4, 6, 8) for hosts in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("n,size,hosts", CASES)
def test_every_item_in_exactly_one_slice_and_every_slice_on_exactly_one_host(n, size, hosts):
    total = slicing.num_slices(n, size)
    geometry = buckets.Geometry.lay_out([(8, 8)], [1], [size], [n])  # a single-size plan's one bucket
    assert geometry.slices == total
    spans = [geometry.slice_span(index) for index in range(total)]
    starts = [0] + [stop for _, stop in spans]
    assert [start for start, _ in spans] == starts[:-1] and starts[-1] == n  # from 0 to n without gaps
    assert all(stop - start == size for start, stop in spans[:-1]) and all(0 < stop - start <= size
                                                                            for start, stop in spans[-1:])
    slots = [slicing.host_slots(h, hosts, total) for h in range(hosts)]
    real = [s for host in slots for s in host if s is not None]
    assert sorted(real) == list(range(total))  # each slice on exactly one host
    assert len({len(host) for host in slots}) == 1  # every host: the same number of steps
    assert len(slots[0]) == slicing.slots_per_host(total, hosts)
    for h, host in enumerate(slots):
        assert [s for s in host if s is not None] == list(range(h, total, hosts))
        # padding slots only at the end
        assert host == [s for s in host if s is not None] + [None] * host.count(None)


@pytest.mark.parametrize("devices,batch,per_slice", list(itertools.product((1, 2, 4, 8), (1, 2, 3), (1, 2, 5))))
def test_slice_size_splits_into_device_steps(devices, batch, per_slice):
    size = slicing.slice_size(devices, batch, per_slice)
    assert size == devices * batch * per_slice
    assert slicing.batches_per_slice(size, devices, batch) == per_slice


def test_uneven_slice_size_for_this_host_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of local devices"):
        slicing.batches_per_slice(6, 4, 1)


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-1, 2, 2)])
def test_slice_size_rejects_non_positive_factors(args):
    with pytest.raises(ValueError):
        slicing.slice_size(*args)


def test_host_slots_rejects_bad_host():
    with pytest.raises(ValueError):
        slicing.host_slots(2, 2, 5)


@pytest.mark.parametrize("images,devices,batch,expected", [
    (0, 4, 8, 2), (999_999, 4, 8, 2),  # a small run keeps today's small slices (64 images here)
    (1_000_000, 4, 8, 32), (10**9, 4, 8, 32),  # 4 chips x batch 8: 1,024 images a slice
    (1_000_000, 8, 1, 128), (1_000_000, 1, 1, 1024), (1_000_000, 4, 3, 85),  # about 1,024 (1,020 here)
    (1_000_000, 8, 256, 2)])  # a step of 2,048 images: never fewer than 2 batches a slice
def test_auto_batches_per_slice_makes_slices_of_about_1024_images_from_a_million(images, devices, batch, expected):
    assert slicing.auto_batches_per_slice(images, devices, batch, most=4096) == expected
    assert slicing.auto_batches_per_slice(images, devices, batch, most=16) == min(expected, 16)

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

import mmvl.data.shm as shm
from mmvl.data.loaders import TrainStream
from mmvl.data.sample import PADDED, DevicePrefetcher, batch_size_of, collate, to_device
from mmvl.errors import UserError
from tests.fixtures.fake_cuda import StreamRecorder


def test_short_sequences_pad_to_the_longest_in_the_batch_not_a_fixed_max():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "input_mask": torch.ones(3, dtype=torch.long)},
             {"input_ids": torch.tensor([8]), "input_mask": torch.ones(1, dtype=torch.long)}]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["input_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_region_features_pad_on_the_region_axis_and_keep_fp16():
    items = [{"features": torch.ones(2, 4, dtype=torch.float16)},
             {"features": torch.ones(5, 4, dtype=torch.float16)}]
    feats = collate(items)["features"]
    assert feats.shape == (2, 5, 4) and feats.dtype == torch.float16
    assert feats[0, 2:].abs().sum() == 0 and feats[1].min() == 1


def test_bool_masks_pad_with_false():
    items = [{"mask": torch.tensor([True, True, True])}, {"mask": torch.tensor([True])}]
    mask = collate(items)["mask"]
    assert mask.dtype == torch.bool and mask.tolist() == [[True] * 3, [True, False, False]]


def test_pad_values_by_key_and_by_nested_path():
    items = [{"labels": torch.tensor([1, 2]), "input_ids": torch.tensor([3, 4]),
              "text": {"labels": torch.tensor([9, 9]), "ids": torch.tensor([1, 1])}},
             {"labels": torch.tensor([1]), "input_ids": torch.tensor([3]),
              "text": {"labels": torch.tensor([9]), "ids": torch.tensor([1])}}]
    batch = collate(items, pad_values={"input_ids": 0, "labels": -100, "text.ids": 7})
    assert batch["labels"].tolist() == [[1, 2], [1, -100]]
    assert batch["input_ids"].tolist() == [[3, 4], [3, 0]]
    assert batch["text"]["labels"].tolist() == [[9, 9], [9, -100]]  # leaf name applies when nested
    assert batch["text"]["ids"].tolist() == [[1, 1], [1, 7]]         # dotted path wins


def test_nested_dicts_strings_none_and_numbers():
    items = [{"id": 3, "question": "what?", "answer": None, "score": 1, "flag": True,
              "meta": {"image": {"w": 640, "name": "a.jpg"}, "scale": 0.5}},
             {"id": 4, "question": "who?", "answer": "cat", "score": 0.5, "flag": False,
              "meta": {"image": {"w": 480, "name": "b.jpg"}, "scale": 1}}]
    batch = collate(items)
    assert batch["id"].dtype == torch.long and batch["id"].tolist() == [3, 4]
    assert batch["question"] == ["what?", "who?"]
    assert batch["answer"] == [None, "cat"]
    assert batch["score"].dtype == torch.float32 and batch["score"].tolist() == [1.0, 0.5]
    assert batch["flag"].dtype == torch.bool
    assert batch["meta"]["image"]["w"].tolist() == [640, 480]
    assert batch["meta"]["image"]["name"] == ["a.jpg", "b.jpg"]
    assert batch["meta"]["scale"].tolist() == [0.5, 1.0]
    assert batch_size_of(batch) == 2


def test_optional_tensor_with_none_stays_a_list():
    items = [{"box": torch.zeros(4)}, {"box": None}]
    assert collate(items)["box"][1] is None


def test_collate_errors_name_the_key():
    with pytest.raises(ValueError, match="'b'"):
        collate([{"a": 1, "b": 2}, {"a": 1}])
    with pytest.raises(ValueError, match="'x.t'"):
        collate([{"x": {"t": torch.zeros(2)}}, {"x": {"t": torch.zeros(2, 2)}}])
    with pytest.raises(ValueError):
        collate([])


def _masked(text, regions, own_zero=False):
    """Samples with text of the given lengths and region counts, all-ones masks (one 0 of its own)."""
    items = [{"input_ids": torch.arange(t), "attention_mask": torch.ones(t, dtype=torch.long),
              "features": torch.zeros(r, 2), "feature_mask": torch.ones(r, dtype=torch.long)}
             for t, r in zip(text, regions)]
    if own_zero:
        items[1]["feature_mask"][-1] = 0
    return items


@pytest.mark.parametrize("text, regions, own_zero, padded", [
    ([4, 4], [3, 3], False, False), ([4, 2], [3, 3], False, True), ([4, 4], [3, 1], False, True),
    ([4, 4], [3, 3], True, True)], ids=["none", "text", "regions", "a-sample's-own-zero"])
def test_the_padded_flag_is_a_host_bool_over_text_and_regions(text, regions, own_zero, padded):
    batch = collate(_masked(text, regions, own_zero))
    assert batch[PADDED] is padded
    assert bool((batch["attention_mask"] == 0).any() or (batch["feature_mask"] == 0).any()) is padded


def test_the_padded_flag_without_masks_and_a_sample_key_of_that_name():
    assert collate([{"image": torch.zeros(3)}, {"image": torch.zeros(3)}])[PADDED] is False
    assert collate([{"attention_mask": torch.ones(2)}, {"attention_mask": None}])[PADDED] is True  # not a tensor
    with pytest.raises(UserError, match="'padded' key.*rename"):
        collate([{PADDED: 1}, {PADDED: 0}])


def test_the_padded_flag_survives_pin_memory_and_to_device(monkeypatch):
    """What the DataLoader's pin-memory thread and the device copy do to a batch (pinning itself
    needs an accelerator: here it returns the tensor, recorded)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(t) or t)
    for padded, text in ((False, [4, 4]), (True, [4, 2])):
        batch = to_device(pin_memory(collate(_masked(text, [3, 3]))), torch.device("cpu"))
        assert batch[PADDED] is padded and batch["attention_mask"].shape == (2, 4)
    assert len(pinned) == 8  # every tensor went through the pinning path


def test_to_device_keeps_containers_and_dtypes():
    Pair = namedtuple("Pair", "a b")
    batch = {"p": Pair(torch.zeros(2, dtype=torch.float16), "s"), "l": [torch.ones(1)], "n": None}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].a.dtype == torch.float16
    assert moved["p"].b == "s" and moved["n"] is None and isinstance(moved["l"], list)


def _items(n):
    return [{"x": torch.tensor([i]), "feat": torch.full((1 + i % 3, 2), i, dtype=torch.float16),
             "name": f"s{i}"} for i in range(n)]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
        else:
            assert a[k] == b[k]


def test_prefetcher_on_cpu_yields_the_same_batches_as_its_source():
    loader = DataLoader(_items(10), batch_size=3, collate_fn=collate)
    prefetcher = DevicePrefetcher(loader, "cpu")
    assert len(prefetcher) == 4
    for _ in range(2):  # each pass is a new epoch of the loader
        got = list(prefetcher)
        expected = list(loader)
        assert len(got) == 4
        for a, b in zip(got, expected):
            _same(a, b)
            assert a["feat"].dtype == torch.float16
    with pytest.raises(StopIteration):
        next(prefetcher)


def _stream():
    return TrainStream(_items(20), batch_size=2, collate_fn=collate, seed=0, rank=0,
                       world_size=1, name="toy")


def test_prefetcher_state_is_of_consumed_batches_so_resume_skips_nothing():
    prefetcher = DevicePrefetcher(_stream(), "cpu")
    for _ in range(13):  # crosses an epoch (10 batches)
        next(prefetcher)
    assert prefetcher.source.state_dict() == {"epoch": 1, "batch": 4}  # one ahead
    state = prefetcher.state_dict()
    assert state == {"epoch": 1, "batch": 3}
    assert prefetcher.epoch == 1 and prefetcher.batches_per_epoch == 10  # forwarded
    expected = [next(prefetcher) for _ in range(5)]

    resumed = DevicePrefetcher(_stream(), "cpu")
    next(resumed)
    resumed.load_state_dict(state)
    for a, b in zip([next(resumed) for _ in range(5)], expected):
        _same(a, b)


def test_cuda_path_copies_ahead_on_the_side_stream_and_waits_before_handing_over(monkeypatch):
    rec = StreamRecorder().install(monkeypatch)
    prefetcher = DevicePrefetcher([{"x": torch.tensor(i)} for i in range(3)], "cuda")
    it = iter(prefetcher)
    assert rec.log == ["copy0:side:async"]  # the first copy starts before any step
    first = next(it)
    assert first["x"].item() == 0
    # batch 0 handed out only after compute waits on the side stream; batch 1 copies meanwhile
    assert rec.log == ["copy0:side:async", "wait", "copy1:side:async"]
    assert [b["x"].item() for b in it] == [1, 2]
    assert rec.log[3:] == ["wait", "copy2:side:async", "wait"]


# -- batches from DataLoader workers travel in reusable shared-memory arenas --------------------

def _rich_items(n):
    """Every kind of value collate handles, with padding, fp16, and samples large enough to be
    copied row by row (> 64 KiB)."""
    return [{"tokens": torch.arange(1 + i % 5), "mask": torch.ones(1 + i % 5, dtype=torch.bool),
             "feat": torch.full((40, 512), float(i), dtype=torch.float16),
             "boxes": torch.full((3 + i % 2, 4), i / 10), "n": i, "score": i / 2, "flag": i % 2 == 0,
             "name": f"s{i}", "maybe": None if i % 3 else torch.tensor(i),
             "nested": {"ids": torch.tensor([i, -i]), "w": 640},
             "feature_mask": torch.tensor([1, 1, int(i != 5)])} for i in range(n)]  # sample 5: one region masked


def _assert_batches_equal(a, b):
    assert type(a) is dict and a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_batches_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], list) and any(isinstance(x, torch.Tensor) for x in a[k]):  # a key with None
            assert [x is None for x in a[k]] == [y is None for y in b[k]], k
            assert all(x is None or torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        else:
            assert a[k] == b[k], k


@pytest.fixture
def fresh_arenas(monkeypatch):
    """This process's arena pool and mappings, emptied for the test and restored after."""
    monkeypatch.setattr(shm, "_POOL", None)
    monkeypatch.setattr(shm, "_MAPPED", {})


@pytest.mark.proc
def test_worker_batches_equal_in_process_collate(fresh_arenas):
    items = _rich_items(23)
    loader = DataLoader(items, batch_size=4, num_workers=2, collate_fn=collate, timeout=60)
    expected = [collate(items[i:i + 4]) for i in range(0, 23, 4)]
    for _ in range(2):
        got = list(loader)
        assert len(got) == len(expected)
        assert [b[PADDED] for b in got] == [False, True, False, False, False, False]  # the flag travels too
        for a, b in zip(got, expected):
            _assert_batches_equal(a, b)
            assert a["nested"]["ids"].untyped_storage().data_ptr() == a["feat"].untyped_storage().data_ptr()


@pytest.mark.proc
def test_held_batches_and_views_are_never_overwritten(fresh_arenas):
    items = _rich_items(40)
    loader = DataLoader(items, batch_size=2, num_workers=1, collate_fn=collate, persistent_workers=True,
                        timeout=60)
    held, view, seen = None, None, 0
    for epoch in range(3):
        for batch in loader:
            if held is None:
                held = batch  # kept whole
            elif view is None:
                view = batch["feat"][1, :3]  # only a view kept; its batch dict and tensors are dropped
            seen += 1
    assert held["n"].tolist() == [0, 1] and torch.all(held["feat"][1] == 1)
    assert torch.all(view == 3) and view.shape == (3, 512)
    assert len(shm._MAPPED) < seen // 4  # arenas were reused, not one per batch


@pytest.mark.proc
def test_worker_side_changes_to_the_batch_travel_too(fresh_arenas):
    def collate_then_edit(items):
        batch = collate(items)
        batch["double"] = batch["feat"].float() * 2  # a tensor made after collate: sent the usual way
        batch["feat_head"] = batch["feat"][:, :2]    # a view into the arena
        batch["nested"]["extra"] = "x"
        return batch

    items = _rich_items(8)
    for batch, i in zip(DataLoader(items, batch_size=4, num_workers=1, collate_fn=collate_then_edit,
                                   timeout=60), (0, 4)):
        assert batch["double"][0, 0, 0].item() == 2 * i and batch["feat_head"].shape == (4, 2, 512)
        assert torch.equal(batch["feat_head"], batch["feat"][:, :2]) and batch["nested"]["extra"] == "x"


class _InWorker:
    id = 0


def test_an_arena_batch_pickles_as_a_plain_dict_and_by_reference_only_on_the_loader_queue(
        fresh_arenas, monkeypatch):
    import copy
    import pickle
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _InWorker())
    items = _rich_items(4)
    batch = collate(items)
    assert isinstance(batch, shm._SharedBatch)
    expected = dict(batch)
    for clone in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):  # torch.save, copy: a dict
        assert type(clone) is dict
        _assert_batches_equal(clone, expected)
    arena = batch._arena
    sent = pickle.loads(ForkingPickler.dumps(batch))  # what the DataLoader queue does, in one process
    _assert_batches_equal(sent, expected)
    assert arena.lent and arena.mm[shm._STATE] == shm._BUSY
    del batch, expected
    assert not arena.local
    assert arena.mm[shm._STATE] == shm._BUSY  # the receiver still holds it
    keep = sent["feat"][2]
    del sent
    assert arena.mm[shm._STATE] == shm._BUSY  # ... through a view
    assert torch.all(keep == 2)
    del keep
    assert arena.mm[shm._STATE] == shm._FREE
    again = collate(items)
    assert again._arena is arena  # reused
    _assert_batches_equal(dict(again), collate(items))


def test_without_memfd_workers_fall_back_to_torch_shared_memory(monkeypatch):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: _InWorker())
    monkeypatch.setattr(shm, "ARENAS", False)
    batch = collate(_rich_items(3))
    assert type(batch) is dict and batch["feat"].is_shared() and batch["tokens"].is_shared()


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_arenas_under_other_start_methods(fresh_arenas, context):
    items = _rich_items(12)
    loader = DataLoader(items, batch_size=4, num_workers=2, collate_fn=collate, timeout=120,
                        multiprocessing_context=context, persistent_workers=True)
    expected = [collate(items[i:i + 4]) for i in range(0, 12, 4)]
    for _ in range(2):
        for a, b in zip(loader, expected):
            _assert_batches_equal(a, b)


@pytest.mark.cuda
def test_prefetcher_on_cuda_copies_pinned_batches_on_a_side_stream_and_hands_them_over_intact(monkeypatch):
    """Pinned batches are copied asynchronously on the side stream while the compute stream is busy;
    the compute stream still reads every batch complete (it waits on the copy), features stay fp16."""
    import mmvl.data.sample as sample

    copies = []
    real = sample.to_device

    def recording(batch, device, non_blocking=True):
        copies.append((torch.cuda.current_stream(device), non_blocking,
                       all(t.is_pinned() for t in (batch["x"], batch["feat"]))))
        return real(batch, device, non_blocking)

    monkeypatch.setattr(sample, "to_device", recording)
    items = [{"x": torch.full((512, 1024), float(i)), "feat": torch.full((36, 2048), i, dtype=torch.float16)}
             for i in range(8)]  # 2 MiB + 144 KiB a sample: copies long enough to overlap
    loader = DataLoader(items, batch_size=2, collate_fn=collate, pin_memory=True)
    prefetcher = DevicePrefetcher(loader, "cuda")
    compute = torch.cuda.current_stream()
    sums = []
    for batch in prefetcher:
        torch.cuda._sleep(2_000_000)  # the compute stream is busy while the next batch copies
        assert batch["x"].is_cuda and batch["feat"].dtype == torch.float16
        sums.append((batch["x"].sum(dim=(1, 2)), batch["feat"].float().sum(dim=(1, 2))))
    torch.cuda.synchronize()
    assert [s.tolist() for s, _ in sums] == [[float(i) * 512 * 1024, float(i + 1) * 512 * 1024]
                                              for i in range(0, 8, 2)]
    assert [f.tolist() for _, f in sums] == [[float(i) * 36 * 2048, float(i + 1) * 36 * 2048]
                                              for i in range(0, 8, 2)]
    assert len(copies) == 4
    for stream, non_blocking, pinned in copies:
        assert stream == prefetcher._side and stream != compute and non_blocking and pinned

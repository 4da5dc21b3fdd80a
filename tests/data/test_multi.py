import io
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.data.loaders import TrainStream
from mmvl.data.multi import MultiStream
from mmvl.registry import MULTITASKING
from mmvl.data.sample import collate
from mmvl.errors import UserError


class FakeStream:
    """The TrainStream surface MultiStream uses, with batches that say where they came from."""

    def __init__(self, name: str, size: int, batches_per_epoch: int = 4):
        self.name, self.dataset = name, range(size)
        self.batches_per_epoch, self.epoch, self.batch = batches_per_epoch, 0, 0

    def __next__(self):
        out = {"pos": torch.tensor([self.epoch, self.batch]), "src": self.name}
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state):
        self.epoch, self.batch = state["epoch"], state["batch"]


def fakes(**sizes):
    return {n: FakeStream(n, s) for n, s in sizes.items()}


def frequencies(stream, n=10_000):
    counts = Counter(next(stream)["dataset_name"] for _ in range(n))
    return {name: counts[name] / n for name in stream.names}


def real_streams(rank=0, world_size=1, seed=3):
    def data(n, offset):
        return [{"x": torch.tensor([offset + i]), "tokens": torch.arange(1 + i % 3)} for i in range(n)]
    return {"vqa": TrainStream(data(24, 0), batch_size=2, collate_fn=collate, seed=seed, rank=rank,
                               world_size=world_size, name="vqa"),
            "caption": TrainStream(data(12, 1000), batch_size=2, collate_fn=collate, seed=seed,
                                   rank=rank, world_size=world_size, name="caption")}


def test_size_proportional_is_the_default_and_matches_size_ratios():
    stream = MultiStream(fakes(a=100, b=300, c=600), None, seed=0)
    assert stream.strategy == "size_proportional"
    freq = frequencies(stream)
    for name, expected in {"a": 0.1, "b": 0.3, "c": 0.6}.items():
        assert abs(freq[name] - expected) < 0.02, freq


def test_batches_carry_their_dataset_name_and_come_from_that_stream():
    stream = MultiStream(fakes(a=10, b=30), {"type": "size_proportional"}, seed=1)
    for _ in range(50):
        batch = next(stream)
        assert isinstance(batch["dataset_name"], str)
        assert batch["dataset_name"] == batch["src"]


def test_round_robin_takes_datasets_in_config_order():
    stream = MultiStream(fakes(b=5, a=1000, c=1), OmegaConf.create({"type": "round_robin"}), seed=0)
    assert [next(stream)["dataset_name"] for _ in range(7)] == ["b", "a", "c", "b", "a", "c", "b"]


def test_ratios_frequencies():
    cfg = {"type": "ratios", "params": {"sampling_ratios": {"a": 1, "b": 3}}}
    freq = frequencies(MultiStream(fakes(a=1000, b=10), cfg, seed=0))
    assert abs(freq["a"] - 0.25) < 0.02 and abs(freq["b"] - 0.75) < 0.02, freq


def test_temperature_flattens_sizes():
    cfg = OmegaConf.create({"type": "temperature", "params": {"temperature": 2.0}})
    stream = MultiStream(fakes(a=100, b=900), cfg, seed=0)  # sqrt sizes: 10 vs 30
    assert stream.probabilities == pytest.approx({"a": 0.25, "b": 0.75})
    freq = frequencies(stream)
    assert abs(freq["a"] - 0.25) < 0.02, freq


@pytest.mark.parametrize("ratios, fragment", [
    ({"a": 1, "bb": 2}, "sampling_ratios.bb"),  # unknown name (did you mean 'b')
    ({"a": 1}, "dataset 'b'"),                  # missing name
    ({"a": 1, "b": 0}, "sampling_ratios.b=0"),  # non-positive
    ({"a": 1, "b": -2.5}, "sampling_ratios.b=-2.5"),
    ({"a": 1, "b": "x"}, "sampling_ratios.b='x'"),
    (None, "sampling_ratios"),
])
def test_ratios_are_validated(ratios, fragment):
    cfg = {"type": "ratios", "params": {"sampling_ratios": ratios}}
    with pytest.raises(UserError, match="multitasking.params") as err:
        MultiStream(fakes(a=1, b=1), cfg, seed=0)
    assert fragment in str(err.value)
    if ratios and "bb" in ratios:
        assert "Did you mean 'b'" in str(err.value)


@pytest.mark.parametrize("t", [None, 0, -1.0, "hot"])
def test_temperature_is_validated(t):
    cfg = {"type": "temperature", "params": {"temperature": t}}
    with pytest.raises(UserError, match="multitasking.params.temperature"):
        MultiStream(fakes(a=1, b=1), cfg, seed=0)


def test_unknown_strategy_and_param_suggest_the_right_name():
    with pytest.raises(UserError, match="Did you mean 'size_proportional'"):
        MultiStream(fakes(a=1, b=1), {"type": "size_proportinal"}, seed=0)
    with pytest.raises(UserError, match="Did you mean 'temperature'"):
        MultiStream(fakes(a=1, b=1), {"type": "temperature", "params": {"temprature": 2}}, seed=0)
    assert set(MULTITASKING.names()) == {"size_proportional", "round_robin", "ratios", "temperature"}


def test_every_rank_draws_the_same_dataset_sequence():
    # Two instances stand in for two ranks: same seed, nothing shared between them.
    ranks = [MultiStream(fakes(a=10, b=20, c=5), None, seed=7) for _ in range(2)]
    seq = [[next(stream)["dataset_name"] for _ in range(1000)] for stream in ranks]
    assert seq[0] == seq[1]
    other = MultiStream(fakes(a=10, b=20, c=5), None, seed=8)
    assert [next(other)["dataset_name"] for _ in range(1000)] != seq[0]


def test_ranks_agree_on_datasets_but_read_their_own_shards():
    # Real TrainStreams at world size 2: the draws match, the samples differ; and
    # global randomness on one rank (e.g. dropout) does not move the draws.
    ranks = [MultiStream(real_streams(rank=r, world_size=2), None, seed=5) for r in (0, 1)]
    names, xs = [[], []], [[], []]
    for _ in range(30):
        for r, stream in enumerate(ranks):
            if r == 1:
                torch.rand(3)
            batch = next(stream)
            names[r].append(batch["dataset_name"])
            xs[r].append(batch["x"].flatten().tolist())
    assert names[0] == names[1]
    assert set(names[0]) == {"vqa", "caption"}
    assert all(set(a).isdisjoint(b) for a, b in zip(xs[0], xs[1]))


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # as checkpoints are loaded


@pytest.mark.parametrize("cfg", [None, {"type": "round_robin"},
                                 {"type": "temperature", "params": {"temperature": 3}}])
def test_state_dict_resumes_the_same_draws_and_batches(cfg):
    first = MultiStream(real_streams(), cfg, seed=11)
    for _ in range(37):
        next(first)
    state = _roundtrip(first.state_dict())
    assert state["draws"] == 37 and set(state["streams"]) == {"vqa", "caption"}
    expected = [next(first) for _ in range(100)]

    resumed = MultiStream(real_streams(), cfg, seed=11)
    next(resumed)  # wherever it was, loading puts it back
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(100)]
    assert [b["dataset_name"] for b in got] == [b["dataset_name"] for b in expected]
    for a, b in zip(got, expected):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["tokens"], b["tokens"])


def test_load_state_dict_rejects_other_datasets():
    stream = MultiStream(fakes(a=1, b=1), None, seed=0)
    other = MultiStream(fakes(a=1, c=1), None, seed=0).state_dict()
    with pytest.raises(UserError, match="same datasets"):
        stream.load_state_dict(other)
    with pytest.raises(UserError, match="single-dataset"):
        stream.load_state_dict({"epoch": 0, "batch": 3})


def test_epoch_and_batches_per_epoch():
    streams = {"a": FakeStream("a", 10, batches_per_epoch=3), "b": FakeStream("b", 50, batches_per_epoch=5)}
    stream = MultiStream(streams, {"type": "round_robin"}, seed=0)
    assert stream.batches_per_epoch == 8
    for _ in range(15):
        next(stream)
    assert stream.epoch == 1
    next(stream)
    assert stream.epoch == 2

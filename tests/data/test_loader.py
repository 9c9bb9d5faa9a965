import numpy as np
import pytest

from lm.data.loader import SplitWindows, TokenLoader, locate, rank_slice, sample_id_at, val_batches
from lm.data.mixture import sample_order
from lm.data.objectives import SpanCorruption
from lm.data.shards import new_manifest, write_manifest, write_shard
from lm.errors import DataError

T = 4


def make_data_dir(path, train_lengths, val_lengths=(9,), base=0):
    """Shards whose tokens count up from `base` across the splits (token value = base + position), so a
    window's first token names it (and, with another `base`, its directory)."""
    path.mkdir()
    splits, offset = {}, base
    for split, lengths in (("train", train_lengths), ("val", val_lengths)):
        shards = []
        for i, n in enumerate(lengths):
            name = f"{split}_{i:05d}.bin"
            write_shard(path / name, np.arange(offset, offset + n, dtype=np.uint16))
            shards.append({"file": name, "tokens": n})
            offset += n
        splits[split] = {"documents": 1, "tokens": sum(lengths), "shards": shards}
    write_manifest(path, new_manifest("gpt2", 50257, 50256, "test", "", splits))
    return path


@pytest.fixture
def data_dir(tmp_path):
    # windows per shard with T=4: (10-1)//4=2, (3-1)//4=0, (17-1)//4=4, (14-1)//4=3 -> N = 9
    return make_data_dir(tmp_path / "data", [10, 3, 17, 14])


def loader(data_dir, rank=0, world=1, batch=4, micro=1, seed=7):
    return TokenLoader(data_dir, "train", T, seed, rank, world, batch, micro)


def firsts(batches) -> list[int]:
    """First input token of every sample, in order."""
    return [int(v) for x, _ in batches for v in x[:, 0]]


def test_sample_order_is_a_seeded_permutation_per_epoch():
    a = sample_order(1, 0, 100)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, sample_order(1, 0, 100))
    assert not np.array_equal(a, sample_order(1, 1, 100))
    assert not np.array_equal(a, sample_order(2, 0, 100))
    assert [sample_id_at(p, 1, 100) for p in (0, 99, 100, 250)] == [
        a[0], a[99], sample_order(1, 1, 100)[0], sample_order(1, 2, 100)[50]]


def test_rank_slice():
    assert rank_slice(8, 8, 0, 2) == range(8, 12)
    assert rank_slice(8, 8, 1, 2) == range(12, 16)
    assert rank_slice(8, 8, 0, 1) == range(8, 16)
    with pytest.raises(ValueError, match=r"train.batch_size: 6 is not divisible by the world size 4"):
        rank_slice(0, 6, 0, 4)


def test_locate():
    cum = np.array([0, 2, 2, 6, 9])
    shard, window = locate(np.array([0, 1, 2, 5, 6, 8]), cum)
    assert shard.tolist() == [0, 0, 2, 2, 3, 3]
    assert window.tolist() == [0, 1, 0, 3, 0, 2]


def test_windows_cover_each_shard_without_overlap(data_dir):
    windows = SplitWindows(data_dir, "train", T)
    assert windows.num_samples == 9
    rows = windows.read_rows(np.arange(9))
    assert rows.dtype == np.int64 and rows.shape == (9, T + 1)
    # shard 0 starts at 0, shard 1 (too short) at 10, shard 2 at 13, shard 3 at 30
    assert rows[:, 0].tolist() == [0, 4, 13, 17, 21, 25, 30, 34, 38]
    assert rows[2].tolist() == [13, 14, 15, 16, 17]
    assert rows[[5, 1]].tolist() == windows.read_rows(np.array([5, 1])).tolist()


def test_next_batch_reads_one_epoch_in_seeded_order(data_dir):
    big = make_data_dir(data_dir.parent / "big", [33, 33])  # 16 windows
    one = loader(big, batch=4, micro=2)
    batches = [one.next_batch() for _ in range(4)]
    assert all(len(b) == 2 and b[0][0].shape == (2, T) for b in batches)
    starts = [s for b in batches for s in firsts(b)]
    ids = [s // T if s < 33 else 8 + (s - 33) // T for s in starts]  # shard 1 starts at token 33, with sample 8
    assert ids == sample_order(7, 0, 16).tolist()
    assert one.state_dict() == {"position": 16}


def test_ranks_split_a_step_disjointly(data_dir):
    single = loader(data_dir, batch=4, micro=2)
    ranks = [loader(data_dir, rank=r, world=2, batch=4, micro=1) for r in range(2)]
    for _ in range(5):  # crosses epoch boundaries (N = 9)
        whole = firsts(single.next_batch())
        parts = [firsts(r.next_batch()) for r in ranks]
        assert parts[0] + parts[1] == whole
        assert not set(parts[0]) & set(parts[1])


def test_resume_from_two_ranks_to_one_and_back(data_dir):
    reference = loader(data_dir, batch=4, micro=4)
    expected = [firsts(reference.next_batch()) for _ in range(6)]

    pair = [loader(data_dir, rank=r, world=2, batch=4, micro=2) for r in range(2)]
    for _ in range(2):
        for r in pair:
            r.next_batch()
    state = pair[0].state_dict()
    assert state == pair[1].state_dict() == {"position": 8}

    one = loader(data_dir, batch=4, micro=1)
    one.load_state_dict(state)
    assert [firsts(one.next_batch()) for _ in range(2)] == expected[2:4]

    back = [loader(data_dir, rank=r, world=2, batch=4, micro=1) for r in range(2)]
    for r in back:
        r.load_state_dict(one.state_dict())
    for step in (4, 5):
        assert firsts(back[0].next_batch()) + firsts(back[1].next_batch()) == expected[step]


def test_epoch_wraparound_uses_a_new_permutation(data_dir):
    one = loader(data_dir, batch=3, micro=3)  # N = 9: epochs end exactly at steps 3 and 6
    epochs = [[s for _ in range(3) for s in firsts(one.next_batch())] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == [0, 4, 13, 17, 21, 25, 30, 34, 38]
    assert epochs[0] != epochs[1]
    straddling = loader(data_dir, batch=4, micro=4)
    straddling.load_state_dict({"position": 7})
    assert firsts(straddling.next_batch()) == epochs[0][7:] + epochs[1][:2]


def test_loader_errors(tmp_path, data_dir):
    message = r"train.batch_size: 6 is not a multiple of train.micro_batch_size \(2\) x world size \(2\)"
    with pytest.raises(ValueError, match=message):
        loader(data_dir, world=2, batch=6, micro=2)
    with pytest.raises(DataError, match=r"no directory .*; run `python -m lm.prepare` first"):
        loader(tmp_path / "missing")
    with pytest.raises(DataError, match=r"no window of data.seq_len \+ 1 = 18 tokens \(its longest shard holds 17\)"):
        TokenLoader(data_dir, "train", 17, 0, 0, 1, 1, 1)


def test_val_batches_are_sequential_and_strided_over_ranks(tmp_path):
    data = make_data_dir(tmp_path / "data", [9], val_lengths=(21, 20))  # val windows: 5 + 4 = 9
    val = SplitWindows(data, "val", T)
    all_windows = val.read_rows(np.arange(9))[:, 0].tolist()
    single = firsts(val_batches(val, 2, 0, 1, 10))
    assert single == all_windows[:8]  # 4 full batches of 2; the last window does not fill a batch
    rank0, rank1 = (firsts(val_batches(val, 2, r, 2, 10)) for r in range(2))
    assert rank0 == all_windows[0:2] + all_windows[4:6]
    assert rank1 == all_windows[2:4] + all_windows[6:8]
    assert firsts(val_batches(val, 2, 1, 2, 1)) == all_windows[2:4]
    x, y = next(val_batches(val, 2, 0, 1, 1))
    assert x.shape == (2, T) and np.array_equal(x[:, 1:], y[:, :-1])


def test_val_batch_errors(tmp_path):
    empty = make_data_dir(tmp_path / "empty", [9], val_lengths=())
    with pytest.raises(DataError, match=r"the val split is empty; prepare with data.val_fraction > 0"):
        SplitWindows(empty, "val", T)
    small = make_data_dir(tmp_path / "small", [9], val_lengths=(9,))
    message = r"val split has 2 windows of data.seq_len=4, fewer than .* \(2\) x world size \(2\)"
    with pytest.raises(DataError, match=message):
        val_batches(SplitWindows(small, "val", T), 2, 0, 2, 10)


def test_on_prepared_data(tiny_data_dir):
    train = TokenLoader(tiny_data_dir, "train", 16, 0, 0, 1, 8, 4)
    assert train.num_samples == 1584
    (x, y), _ = train.next_batch()
    assert x.shape == (4, 16) and int(x.max()) <= 50256
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert len(list(val_batches(SplitWindows(tiny_data_dir, "val", 16), 4, 0, 1, 1000))) == 355 // 4


def keys_of(rows, keys):
    """An objective that returns the keys the loader passed, to see them."""
    return (keys,)


def test_objective_keys_are_global_positions_and_val_sample_ids(data_dir):
    ranks = [TokenLoader(data_dir, "train", T, 7, r, 2, 8, 2, keys_of) for r in range(2)]
    for r in ranks:
        r.load_state_dict({"position": 16})
    assert [k.tolist() for (k,) in ranks[0].next_batch()] == [[16, 17], [18, 19]]
    assert [k.tolist() for (k,) in ranks[1].next_batch()] == [[20, 21], [22, 23]]
    val = SplitWindows(data_dir, "val", T)  # 2 windows
    assert [k.tolist() for (k,) in val_batches(val, 1, 1, 2, 10, keys_of)] == [[1]]


def span_loaders(data, world, micro):
    objective = SpanCorruption(0, 50257, 4, 50261, 33)  # windows of 33 tokens: 5 noise tokens in 2 spans
    return [TokenLoader(data, "train", 32, 7, r, world, 4, micro, objective) for r in range(world)]


def joined(micro_batches) -> list[np.ndarray]:
    """The micro-batches' tensors, each joined along the batch."""
    return [np.concatenate(parts) for parts in zip(*micro_batches)]


def test_span_corruption_is_the_same_at_any_world_size_and_after_resume(tmp_path):
    data = make_data_dir(tmp_path / "data", [200, 150])  # 6 + 4 windows of 32 tokens
    one, = span_loaders(data, world=1, micro=2)
    pair = span_loaders(data, world=2, micro=1)
    patterns = set()  # where the sentinels sit in each source
    for step in range(8):  # crosses epoch boundaries (N = 10)
        if step == 5:  # fresh loaders, with another micro-batch size, resumed from the pair's state
            state = pair[0].state_dict()
            pair = span_loaders(data, world=2, micro=2)
            for r in pair:
                r.load_state_dict(state)
        src, tgt_in, tgt_out = joined(one.next_batch())
        parts = [joined(r.next_batch()) for r in pair]
        for whole, rank0, rank1 in zip((src, tgt_in, tgt_out), *parts):
            assert np.array_equal(whole, np.concatenate([rank0, rank1]))
        assert src.shape == (4, 33 - 5 + 2) and tgt_out.shape == (4, 5 + 2 + 1)
        patterns |= {tuple(np.flatnonzero(row >= 50257).tolist()) for row in src}
    assert len(patterns) > 10


def test_rank_slice_refuses_a_rank_outside_the_world():
    # ranks of a world of 2 are 0 and 1: rank 2 would read positions [8, 12) of the next step
    with pytest.raises(ValueError, match=r"rank 2 is outside a world of size 2"):
        rank_slice(0, 8, 2, 2)
    with pytest.raises(ValueError, match=r"rank -1 is outside a world of size 2"):
        rank_slice(0, 8, -1, 2)


def test_an_id_equal_to_the_vocabulary_size_is_refused_with_its_position(tmp_path):
    # tokens 50249..50257 (vocab 50257): window 0 is [50249..50253]; window 1 starts at token 4, [50253..50257],
    # and its largest id, 50257, one past the vocabulary, is token 4 + 4 = 8 of the shard
    data = make_data_dir(tmp_path / "data", [9], base=50249)
    windows = SplitWindows(data, "train", T)
    assert windows.read_rows(np.array([0]))[0].tolist() == [50249, 50250, 50251, 50252, 50253]
    with pytest.raises(DataError, match=r"train_00000.bin: token 50257 at position 8 is not below the vocabulary "
                                        r"size 50257"):
        windows.read_rows(np.array([1]))


def test_a_loader_moved_back_reads_again_what_it_read_there(tmp_path):
    # a mixture loader counts each source's draws incrementally; a load_state_dict to an earlier position
    # must count again from the start, so the batch at position 0 is the same the second time
    a = make_data_dir(tmp_path / "a", [41])
    b = make_data_dir(tmp_path / "b", [41], base=1000)
    loader = TokenLoader([a, b], "train", T, 3, 0, 1, 4, 4, weights=[1, 1])
    first = loader.next_batch()
    loader.next_batch()
    loader.next_batch()
    loader.load_state_dict({"position": 0})
    assert loader.draws_per_source().tolist() == [0, 0]
    again = loader.next_batch()
    assert all(np.array_equal(u, v) for one, two in zip(first, again) for u, v in zip(one, two))
    assert loader.draws_per_source().sum() == 4

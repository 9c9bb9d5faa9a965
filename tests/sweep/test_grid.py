import pytest

from lm.config import load_config
from lm.errors import SweepError
from lm.sweep.grid import expand, overrides, parse_grid, run_name


def test_values_are_read_as_yaml_scalars():
    grid = parse_grid(["model.n_layer=2,4", "optim.lr=3e-3,1e-2", "model.arch=gpt,lstm", "log.tensorboard=true,false"])
    assert grid == {"model.n_layer": [2, 4], "optim.lr": [0.003, 0.01], "model.arch": ["gpt", "lstm"],
                    "log.tensorboard": [True, False]}
    assert overrides({"log.tensorboard": False, "optim.lr": 0.003}) == ["--log.tensorboard=false", "--optim.lr=0.003"]
    cfg = load_config(None, overrides({"log.tensorboard": False, "optim.lr": 0.003, "model.n_layer": 2}))
    assert (cfg.log.tensorboard, cfg.optim.lr, cfg.model.n_layer) == (False, 0.003, 2)


def test_every_combination_in_order_the_last_key_fastest():
    grid = parse_grid(["model.n_layer=2,4", "model.n_head=2,4", "optim.lr=1e-3,3e-3"])
    combos = expand(grid)
    assert len(combos) == 8
    assert combos[0] == {"model.n_layer": 2, "model.n_head": 2, "optim.lr": 0.001}
    assert combos[1] == {"model.n_layer": 2, "model.n_head": 2, "optim.lr": 0.003}
    assert combos[-1] == {"model.n_layer": 4, "model.n_head": 4, "optim.lr": 0.003}
    assert len({tuple(c.values()) for c in combos}) == 8


def test_random_draws_distinct_combinations_reproducibly():
    grid = parse_grid(["model.n_layer=1,2,3,4", "optim.lr=1e-3,3e-3,1e-2"])
    drawn = expand(grid, sample=5, seed=7)
    assert len(drawn) == 5 and len({tuple(c.values()) for c in drawn}) == 5
    assert drawn == expand(grid, sample=5, seed=7)
    assert drawn != expand(grid, sample=5, seed=8)
    all_runs = expand(grid)
    assert [all_runs.index(c) for c in drawn] == sorted(all_runs.index(c) for c in drawn)  # kept in grid order
    assert expand(grid, sample=12, seed=3) == all_runs  # every combination may be drawn
    with pytest.raises(SweepError, match="--random: 13 runs asked for, but the grid has 12 combinations"):
        expand(grid, sample=13)
    with pytest.raises(SweepError, match="--random: 0 runs"):
        expand(grid, sample=0)


def test_run_names_show_the_values_and_differ_with_the_config():
    combo = {"model.n_layer": 2, "optim.lr": 0.003}
    a = run_name(combo, load_config(None, overrides(combo)).to_dict())
    b = run_name(combo, load_config(None, overrides(combo) + ["--model.d_model=384"]).to_dict())
    assert a.startswith("n_layer=2_lr=0.003-") and b.startswith("n_layer=2_lr=0.003-") and a != b
    assert a == run_name(combo, load_config(None, overrides(combo)).to_dict())  # stable: a rerun finds it
    assert "/" not in run_name({"log.sample_prompt": "a/b c"}, {})


@pytest.mark.parametrize("items, message", [
    ([], "--grid: empty"),
    (["model.n_layer"], "--grid model.n_layer: expected SECTION.KEY=V1,V2"),
    (["n_layer=2,4"], "--grid n_layer=2,4: expected SECTION.KEY=V1,V2"),
    (["model.n_layer=2,", "optim.lr=1e-3"], "--grid model.n_layer=2,: empty value"),
    (["model.n_layer="], "--grid model.n_layer=: empty value"),
    (["model.n_layer=2", "model.n_layer=4"], "--grid model.n_layer: given twice"),
    (["model.n_layer=2,2"], "--grid model.n_layer: a value is listed twice"),
    (["data.dir=a,b"], "--grid data.dir: every run of a sweep has the same data"),
    (["train.seed=1,2"], "--grid train.seed: every run of a sweep has the same data, seed"),
    (["train.steps=10,20"], "--grid train.steps: every run"),
    (["train.out_dir=a,b"], "--grid train.out_dir: every run"),
])
def test_bad_grids_are_refused_naming_the_item(items, message):
    with pytest.raises(SweepError) as err:
        parse_grid(items)
    assert message in str(err.value)


@pytest.mark.parametrize("item", ["train.batch_size=8,16", "data.seq_len=64,128"])
def test_a_grid_over_the_global_batch_or_the_window_is_refused(item):
    # each run of a sweep must see the same tokens: a batch or window in the grid changes the budget per step
    with pytest.raises(SweepError, match="every run of a sweep has the same data, seed, token budget"):
        parse_grid([item])

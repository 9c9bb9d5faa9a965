import math

import pytest

from lm.config import ScheduleConfig
from lm.training.schedule import lr_at


def test_warmup_is_linear_from_the_first_step():
    cfg = ScheduleConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 1.0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(4, 1.0, cfg, 100) == pytest.approx(0.5)
    assert lr_at(9, 1.0, cfg, 100) == pytest.approx(1.0)


def test_cosine_reaches_the_floor_and_stays():
    cfg = ScheduleConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(10, 2.0, cfg, 110) == pytest.approx(2.0)
    assert lr_at(60, 2.0, cfg, 110) == pytest.approx(0.2 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 1.8)
    assert lr_at(110, 2.0, cfg, 110) == pytest.approx(0.2)
    assert lr_at(500, 2.0, cfg, 110) == pytest.approx(0.2)


def test_decay_steps_overrides_total():
    cfg = ScheduleConfig(warmup_steps=0, decay_steps=50, min_lr_ratio=0.0)
    assert lr_at(50, 1.0, cfg, 1000) == 0.0
    assert lr_at(25, 1.0, cfg, 1000) == pytest.approx(0.5)
    values = [lr_at(s, 1.0, cfg, 1000) for s in range(51)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_a_decay_that_ends_where_warmup_ends_is_at_the_floor_from_that_step():
    # schedule.decay_steps may equal warmup_steps (the config refuses only less): the step where the decay
    # ends is at min_lr_ratio * lr, the warmup's last step at the peak
    cfg = ScheduleConfig(warmup_steps=10, decay_steps=10, min_lr_ratio=0.1)
    assert lr_at(9, 2.0, cfg, 100) == pytest.approx(2.0)
    assert [lr_at(s, 2.0, cfg, 100) for s in (10, 11, 99)] == pytest.approx([0.2, 0.2, 0.2])

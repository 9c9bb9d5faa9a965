import pytest

from lm import errors


@pytest.mark.parametrize("kind, builtin", [
    (errors.ConfigError, ValueError), (errors.DataError, ValueError), (errors.TokenizerError, RuntimeError),
    (errors.CheckpointError, RuntimeError), (errors.TrainingError, RuntimeError), (errors.PromptError, ValueError),
    (errors.ExportError, ValueError), (errors.MetricsError, ValueError), (errors.PlotError, ValueError),
    (errors.SweepError, ValueError),
])
def test_each_error_kind_is_an_lm_error_and_the_builtin_it_refines(kind, builtin):
    # the CLI turns any LMError into one line; callers that catch the builtin (ValueError) keep catching it
    assert issubclass(kind, errors.LMError) and issubclass(kind, builtin)
    with pytest.raises(builtin, match="x.json: bad"):
        raise kind("x.json: bad")

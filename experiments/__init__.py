"""Experiments and one-off measurements: the baselines and comparisons the docs report, each a script that
prints its tables (`python -m experiments.<name> --help`). They use lm as a user would and are not part of the
package; their tests are under tests/experiments."""

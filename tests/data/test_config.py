"""DataConfig validation."""

import dataclasses

import pytest

from aiinfra_jax.data.config import DataConfig


def test_defaults_and_coercion():
    cfg = DataConfig()
    assert cfg.sources == ("embedded",) and cfg.seq_len == 256 and cfg.batch_size == 16
    cfg = DataConfig(sources=["a", "b"], weights=[1, 3])
    assert cfg.sources == ("a", "b") and cfg.weights == (1, 3)
    assert cfg.mixture_weights == (0.25, 0.75)
    assert DataConfig(sources=("a", "b")).mixture_weights == (0.5, 0.5)
    hash(cfg)
    staged = DataConfig(sources=["a", "b"], weights=[1, 0], stages=[[100, [1, 3]], (250, (0, 2))])
    assert staged.stages == ((100, (1, 3)), (250, (0, 2)))
    assert staged.stage_weights == ((0, (1.0, 0.0)), (100, (0.25, 0.75)), (250, (0.0, 1.0)))
    hash(staged)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"sources": ()}, r"DataConfig.sources=\(\) must be a non-empty tuple"),
        ({"sources": "embedded"}, r"DataConfig.sources='embedded' must be a tuple.*\('embedded',\)"),
        ({"sources": ("embedded", "")}, r"sources contains ''"),
        ({"weights": (1.0, 2.0)}, r"DataConfig.weights=\(1.0, 2.0\) has 2 entries but there are 1 sources"),
        ({"sources": ("a", "b"), "weights": (1.0, -1.0)}, r"finite number >= 0, got -1.0"),
        ({"sources": ("a", "b"), "weights": (1.0, float("nan"))}, r"finite number >= 0, got nan"),
        ({"sources": ("a", "b"), "weights": (0, 0.0)}, r"at least one weight must be > 0"),
        ({"sources": ("a", "b"), "weights": (1, 0)}, r"give sources \['b'\] weight 0 and there are no stages"),
        ({"sources": ("a", "b"), "weights": (1, 0), "stages": ((10, (2, 0)),)},
         r"sources \['b'\] have weight 0 in every stage"),
        ({"sources": ("a", "b"), "stages": ((0, (1, 1)),)}, r"stages\[0\] starts at step 0; .* > 0 and increasing"),
        ({"sources": ("a", "b"), "stages": ((5, (1, 1)), (5, (1, 2)))},
         r"stages\[1\] starts at step 5; .*\(the previous stage starts at 5\)"),
        ({"sources": ("a", "b"), "stages": ((5, (1, 1, 1)),)}, r"stages\[0\] weights=\(1, 1, 1\) has 3 entries"),
        ({"sources": ("a", "b"), "stages": ((5,),)}, r"stages\[0\]=\(5,\) must be a pair \(start_step, weights\)"),
        ({"sources": ("a", "b"), "stages": "late"}, r"must be a tuple of \(start_step, weights\) pairs"),
        ({"text_field": ""}, r"DataConfig.text_field='' must be a non-empty string"),
        ({"tokenizer": ""}, r"DataConfig.tokenizer='' must be 'byte' or a path"),
        ({"seq_len": 0}, r"DataConfig.seq_len=0 must be an integer >= 1"),
        ({"seq_len": 8.0}, r"DataConfig.seq_len=8.0 must be an integer >= 1"),
        ({"batch_size": True}, r"DataConfig.batch_size=True must be an integer >= 1"),
        ({"num_workers": -1}, r"DataConfig.num_workers=-1 must be an integer >= 0"),
        ({"val_fraction": 1.0}, r"DataConfig.val_fraction=1.0 must be a number in \[0, 1\)"),
        ({"val_fraction": -0.1}, r"DataConfig.val_fraction=-0.1 must be a number in \[0, 1\)"),
        ({"long_documents": "truncate"}, r"DataConfig.long_documents='truncate' is not one of \('split', 'error'\)"),
    ],
)
def test_validation_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DataConfig(**kwargs)


def test_shuffle_seed_is_retired():
    """The shuffles are seeded by make_iterator's seed (the trainer passes run.seed); the old
    data.shuffle_seed, which the trainer never read, is gone, and listed as retired so that a
    config saved with it can be read with a note (RETIRED_FIELDS)."""
    assert "shuffle_seed" not in {f.name for f in dataclasses.fields(DataConfig)}
    assert "run.seed" in DataConfig.RETIRED_FIELDS["shuffle_seed"]
    with pytest.raises(TypeError):
        DataConfig(shuffle_seed=0)

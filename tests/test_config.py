from pathlib import Path

import pytest

from exatrain.train.config import ConfigError, load_config, micro_batch_size, parse_override

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_example_file_is_the_built_in_default():
    assert load_config(EXAMPLES / "cosmoflow.toml").to_dict() == load_config(None).to_dict()


def test_kfac_example_is_the_default_job_with_kfac_only():
    """examples/cosmoflow-kfac.toml changes the optimizer (and stops at the target, evaluating
    every 100 steps); the rest is the default job the K-FAC bench measured."""
    kfac, default = (load_config(EXAMPLES / f).to_dict()
                     for f in ("cosmoflow-kfac.toml", "cosmoflow.toml"))
    assert kfac["optim"] == {**default["optim"], "name": "kfac"}   # K-FAC's defaults are its recipe
    for section in kfac:
        if section in ("optim", "train"):
            continue
        assert kfac[section] == default[section], section
    changed = {k for k in kfac["train"] if kfac["train"][k] != default["train"][k]}
    assert changed == {"target", "eval_every"}


def test_overrides_are_parsed_as_toml():
    assert parse_override("train.steps=12") == ("train", "steps", 12)
    assert parse_override("plan.space=[1, 2, 2]") == ("plan", "space", [1, 2, 2])
    assert parse_override("data.path=some/dir") == ("data", "path", "some/dir")
    config = load_config(None, ["optim.lr=1e-2", "model.size=64", "data.size=64"])
    assert config.optim.lr == 0.01 and config.model.size == 64
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("steps=3")


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown key train\.stpes\. Did you mean 'steps'\?"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"unknown key model\.sise\. Did you mean 'size'\?"):
        load_config(None, ["model.sise=3"])
    with pytest.raises(ConfigError, match=r"unknown section \[trian\]\. Did you mean 'train'\?"):
        load_config(None, ["trian.steps=3"])


def test_typo_in_a_file_names_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        load_config(path)
    (tmp_path / "broken.toml").write_text("[optim\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "broken.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match="train.steps must be int, got 'ten'"):
        load_config(None, ["train.steps='ten'"])
    with pytest.raises(ConfigError, match="optim.name='adamx' is not one of adamw, adam, sgd, kfac. Did you mean"):
        load_config(None, ["optim.name='adamx'"])
    with pytest.raises(ConfigError, match="run.workload='cosmoflo'.*Did you mean 'cosmoflow'"):
        load_config(None, ["run.workload='cosmoflo'"])
    with pytest.raises(ConfigError, match="parallel.branches='data'.*Set parallel.branches='none'"):
        load_config(None, ["optim.name='kfac'", "parallel.branches='data'", "plan.data=2"])


def test_batch_must_split_over_replicas_and_accumulation():
    config = load_config(None, ["train.batch_size=10", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"batch_size=10 does not split over 2 data replicas × 2"):
        micro_batch_size(config, 2)
    assert micro_batch_size(load_config(None, ["train.batch_size=16", "train.grad_accum=2"]), 2) == 4


def test_plan_section_resolves_against_world_size():
    assert str(load_config(None).plan.resolve(4)) == "Plan(data=4)"
    from exatrain.plan import PlanError
    with pytest.raises(PlanError, match="needs 3 ranks but the job has 4"):
        load_config(None, ["plan.data=3"]).plan.resolve(4)

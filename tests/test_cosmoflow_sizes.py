"""A CosmoFlow model whose input cube differs from the data's is refused at build time, with a
message naming both sizes, the data and the fix (not a matmul shape error mid-step)."""

from __future__ import annotations

from exatrain.cli import main


def test_model_size_that_does_not_fit_the_data_is_refused(cosmo_data, tmp_path, capsys):
    code = main(["run", "--nproc", "1", "--set", f"data.path={cosmo_data}", "--set",
                 "data.generate=false", "--set", "model.size=32", "--set",
                 f"run.out_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.size=32 expects 32³ samples" in err and "16×16×16" in err
    assert str(cosmo_data) in err and "set model.size=16 and data.size=16" in err


def test_existing_data_of_another_size_explain_why_nothing_was_generated(cosmo_data, tmp_path,
                                                                        capsys):
    code = main(["run", "--nproc", "1", "--set", f"data.path={cosmo_data}", "--set",
                 "data.generate=true", "--set", "data.size=64", "--set", "model.size=64",
                 "--set", f"run.out_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.size=64 expects 64³ samples" in err and "16×16×16" in err
    assert "already holds data, so nothing was generated" in err
    assert "set data.size=64 and a data.path that does not exist yet" in err

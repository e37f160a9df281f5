"""A malformed YAML recipe (or --set value) is one line naming the file, line and column."""

from __future__ import annotations

import pytest

from diffattn.cli import main


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("model:\n  preset: tiny\n attention: x\n", "line 3, column 2"),
        ("steps: [1, 2\n", "line 2, column 1"),
        ('run_name: "open\n', "line 2, column 1"),
    ],
)
def test_malformed_recipe_is_one_line_with_file_line_and_column(tmp_path, capsys, text, where):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text(text, encoding="utf-8")
    assert main(["train", str(recipe), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(recipe) in err and where in err and "not valid YAML" in err
    assert not (tmp_path / "out").exists()


def test_malformed_set_value_and_undecodable_recipe_are_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps: 1\n", encoding="utf-8")
    assert main(["train", str(recipe), "--set", "optim.betas=[0.9,"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "optim.betas" in err and "column" in err
    recipe.write_bytes(b"\xff\xfe")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(recipe) in err


def test_malformed_compare_recipe_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "c.yaml"
    recipe.write_text("steps: [\n", encoding="utf-8")
    assert main(["compare", "--config", str(recipe), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "line 2, column 1" in err

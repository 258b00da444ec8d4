"""Bad input on the command line (a path, a file, a field in a model's config.json) ends every ``xinserve``
command with one line on stderr naming the file or field, and exit status 2: never a traceback."""

import json
import subprocess
import sys

import pytest

from xinserve.server.cli.main import main


def one_line_naming(err: str, *names: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and "Traceback" not in err and all(name in lines[0] for name in names)


def config_with(tiny_models, tmp_path, **fields) -> str:
    config = json.loads((tiny_models("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return str(tmp_path)


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("num_hidden_layers", -1),
                                          ("hidden_size", "wide")])
def test_plan_of_a_config_with_a_shape_that_is_not_a_positive_integer_exits_2_naming_it(
        tiny_models, tmp_path, capsys, field, value):
    path = config_with(tiny_models, tmp_path, **{field: value})
    capsys.readouterr()  # the fixture's progress bar
    assert main(["plan", "--model", path]) == 2
    err = capsys.readouterr().err
    assert one_line_naming(err, "xinserve plan:", f"{tmp_path / 'config.json'}", field), err


def test_plan_of_a_missing_directory_says_it_has_no_config_json(capsys):
    assert main(["plan", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert one_line_naming(err, "/nonexistent", "config.json"), err
    assert "Repo id" not in err


def test_serve_with_a_config_that_is_not_utf8_exits_2_naming_the_file(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xffmodels: []\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert one_line_naming(err, "xinserve serve:", str(path), "UTF-8"), err


def test_serve_with_a_missing_config_exits_2_naming_the_file(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert one_line_naming(capsys.readouterr().err, "xinserve serve:", "missing.yaml")


@pytest.mark.parametrize("content", [None, b"\xff\xfe{}\n"], ids=["missing", "not-utf8"])
def test_bench_with_an_unreadable_dataset_exits_2_naming_it(tmp_path, capsys, content):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_bytes(content)
    assert main(["bench", "--dataset", str(path), "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert one_line_naming(err, "xinserve bench:", str(path)), err


def test_bench_plot_of_a_missing_results_file_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "results.json"
    assert main(["bench", "plot", str(path), "--out", str(tmp_path / "plot.png")]) == 2
    assert one_line_naming(capsys.readouterr().err, "xinserve bench:", str(path))


def test_doctor_versions_leave_stderr_clean_at_exit():
    """Reading triton's version by importing it left ~30 lines of "nanobind: leaked" on stderr at exit
    (its objects are still alive when the CLI freezes the heap and leaves)."""
    script = ("import sys, json; from xinserve.server.cli.doctor import versions; "
              "from xinserve.engines.worker.process_exit import leave_quickly; "
              "print(json.dumps([versions(), 'triton' in sys.modules])); leave_quickly()")
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    found, triton_imported = json.loads(done.stdout)
    assert not triton_imported
    assert found["torch"].startswith("2.")
    if _installed("triton"):
        assert found["triton"]  # still reported, from its installed metadata


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True

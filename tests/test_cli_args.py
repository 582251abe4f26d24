"""Bounded-number flags (everybyte/cli_args): a value out of range is a usage error naming the flag,
before a model loads or a run starts."""
from __future__ import annotations

import pytest

from everybyte.cli_args import counts, numbers
from everybyte.cluster import cli as cluster_cli
from everybyte.cluster import router_cli
from everybyte.serve import cli as serve_cli


@pytest.mark.parametrize("build_parser, argv", [
    (serve_cli.build_parser, []),
    (router_cli.build_parser, ["--worker", "http://127.0.0.1:1"]),
    (cluster_cli.build_parser, []),
])
@pytest.mark.parametrize("value, message", [
    ("70000", "must be a TCP port, 0 to 65535; got '70000'"),       # was an OverflowError after the model loaded
    ("-1", "must be a TCP port, 0 to 65535; got '-1'"),
    ("http", "expected a whole number, got 'http'"),
])
def test_a_port_out_of_range_is_a_usage_error(build_parser, argv, value, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--port", value])
    assert e.value.code == 2 and f"argument --port: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-queue", "--max-body-bytes", "--kv-events-buffer"])
def test_serve_limits_below_one_are_usage_errors(flag, capsys):       # --max-queue -1 answered every request 429
    with pytest.raises(SystemExit) as e:
        serve_cli.build_parser().parse_args([flag, "0"])
    assert e.value.code == 2 and f"argument {flag}: must be >= 1, got '0'" in capsys.readouterr().err


def test_a_port_in_range_parses():
    assert serve_cli.build_parser().parse_args(["--port", "0"]).port == 0
    assert router_cli.build_parser().parse_args(["--worker", "http://127.0.0.1:1", "--port", "65535"]).port == 65535


def test_lists_name_their_flag():
    assert counts("--batches", "1,4,8") == [1, 4, 8]
    assert numbers("--interactivity", "50,160.5") == [50.0, 160.5]
    for bad in ("", "1,,2", "1,0", "x"):
        with pytest.raises(ValueError, match="--batches needs comma-separated whole numbers >= 1"):
            counts("--batches", bad)
    for bad in ("", "1,x", "inf", "nan"):
        with pytest.raises(ValueError, match="--interactivity needs comma-separated numbers"):
            numbers("--interactivity", bad)


@pytest.mark.parametrize("argv, message", [
    (["bench", "kv-transfer", "--requests", "0"], "argument --requests: must be >= 1"),      # was an IndexError
    (["bench", "serve", "--max-tokens", "0"], "argument --max-tokens: must be >= 1"),        # a StatisticsError
    (["bench", "formats", "--repeats", "0"], "argument --repeats: must be >= 1"),            # a StatisticsError
    (["bench", "memory", "--sessions", "-2"], "argument --sessions: must be >= 1"),
    (["bench", "cluster", "--duration", "-1"], "argument --duration: must be > 0"),
    (["bench", "engine", "--new-tokens", "0"], "argument --new-tokens: must be >= 1"),
])
def test_bench_flags_out_of_range_are_refused_before_the_run(argv, message, capsys):
    from everybyte.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_model_path_that_is_not_there_is_one_line_not_a_traceback(tmp_path, capsys):
    from everybyte.cli import main
    missing = tmp_path / "none.gguf"
    assert main(["generate", "hi", "--model", str(missing)]) == 2
    assert f"everybyte generate: error: model path not found: {missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(missing)])
    assert e.value.code == f"everybyte serve: model path not found: {missing}"


def test_check_writable_skips_none_and_checks_every_path(tmp_path):
    from everybyte.json_output import check_writable
    check_writable(None, str(tmp_path / "a" / "out.json"), None)            # makes the folder
    check_writable(str(tmp_path / "d1" / "d2"), directory=True)
    assert (tmp_path / "a").is_dir() and (tmp_path / "d1" / "d2").is_dir()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "d1", "d2"]  # no scratch file left
    with pytest.raises(OSError, match="cannot write .*it is a directory"):
        check_writable(str(tmp_path / "ok.json"), str(tmp_path / "a"))     # the second path is a folder
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=f"cannot write '{blocker}/x.json'"):
        check_writable(str(blocker / "x.json"))

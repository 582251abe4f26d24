import json

from everybyte.bench.micro.disk_reader import main


def test_disk_reader_bench_reports_each_reader_against_the_plain_read(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["--mib", "1", "--reps", "1", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == out and out["file_bytes"] == 1 << 20
    for run in ("idle", "busy_python_thread"):
        assert set(out["runs"][run]["vs_plain_read"]) <= {"c", "python"} and "python" in out["runs"][run]["vs_plain_read"]
        assert all(v > 0 for v in out["runs"][run]["bytes_s"].values())

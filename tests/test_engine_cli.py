"""`everybyte generate`: streams a real generation; bad input exits 2 with the field named."""
from everybyte.cli import main


def test_generate_streams_text(capsys):
    rc = main(["generate", "The capital of France is", "--max-tokens", "4", "--kv-cache", "32MiB", "--temperature", "0",
               "--max-model-len", "256", "--stats"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Paris" in out and "finish_reason" in err


def test_generate_bad_input(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--kv-cache", "12 parsecs"]) == 2
    assert "cannot parse size" in capsys.readouterr().err

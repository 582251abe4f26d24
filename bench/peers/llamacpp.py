"""Peer: llama.cpp's OpenAI-compatible server from `llama-cpp-python[server]`.

Loaded by `everybyte bench compare --peers llamacpp`; not part of .ci/run. Install once (it
compiles llama.cpp from source, about 7 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python[server]"

The server is started as `python -m llama_cpp.server --model GGUF --n_ctx N --n_threads T ...`
with its prompt cache on (`--cache true`, RAM, `--cache_size` bytes) and `--interrupt_requests false`
(by default a new request cancels the one streaming), and it is ready when
/v1/models answers.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

NAME = "llama.cpp"
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python[server]"'
INSTALL_NOTE = "compiles llama.cpp from source, about 7 minutes on 2 cores; see bench/peers/README.md"
# llama_cpp.server imports these; missing any of them means the [server] extra is not installed.
_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


def missing() -> list[str]:
    """Python modules the peer needs that are not importable here (empty: installed)."""
    return [f"Python module {m}" for m in _MODULES if importlib.util.find_spec(m) is None]


def version() -> str | None:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def command(model: str, port: int, *, n_ctx: int, threads: int, parallel: int,
            cache_bytes: int | None = None, kv_bytes: int | None = None,
            host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """The server's command line and what each setting means for the comparison.

    llama-cpp-python's server runs one llama.cpp context and serves one completion at a time
    (a lock around the model): it has no parallel-slots option (`llama-server --parallel` of the
    C++ build is not in this package), so with --concurrency C the other C-1 lanes queue at the
    server. Its prompt cache keeps whole-context KV snapshots in RAM (LlamaCache) up to
    --cache_size bytes and reuses the longest matching prefix of a new prompt.
    """
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", host, "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--cache", "true", "--cache_type", "ram", "--interrupt_requests", "false"]
    if cache_bytes:
        cmd += ["--cache_size", str(int(cache_bytes))]
    notes = {
        "context": f"--n_ctx {n_ctx} (one llama.cpp context; its live KV is n_ctx f16 cells, fixed size)",
        "threads": f"--n_threads {threads} --n_threads_batch {threads}",
        "parallel_slots": f"1: llama-cpp-python's server serves one request at a time and has no "
                          f"parallel-slots option; the {parallel} lane(s) of the replay queue at the server",
        "interrupt_requests": "false: by default this server cancels the streaming request whenever another "
                              "one arrives, which would cut every concurrent turn short",
        "prompt_cache": "on: --cache true --cache_type ram" + (f" --cache_size {int(cache_bytes)}" if cache_bytes
                                                                else " (package default size, 2 GiB)"),
        "kv_budget": "not settable like everybyte's --kv-cache" + (f" ({kv_bytes} bytes)" if kv_bytes else "")
                     + ": the live KV is sized by n_ctx; the prompt cache (RAM snapshots of whole contexts) is "
                       "bounded by --cache_size",
        "prompts": "text: its /v1/completions takes `prompt` as str or list[str], not token ids (0.3.x), so the "
                   "replay's auto-detection sends text; its tokenizer is at /extras/tokenize, not /tokenize",
        "usage": "its stream reports no cached_tokens, so prefix_hit_rate is not measured for it",
        "ignore_eos": "not supported by this server's /v1/completions; a turn may end before max_tokens "
                      "(see output_length_match)",
    }
    return cmd, notes

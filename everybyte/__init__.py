"""everybyte: an LLM inference engine for agentic workloads."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "default_model_path", "__version__"]


def __getattr__(name):  # lazy, so `import everybyte.formats` does not load the engine
    if name in ("LLM", "SamplingParams"):
        from everybyte.engine import llm, sampling_params
        return {"LLM": llm.LLM, "SamplingParams": sampling_params.SamplingParams}[name]
    if name == "default_model_path":   # the embedded default model's GGUF (fetched once, then cached)
        from everybyte.models.default_model import default_model_path
        return default_model_path
    raise AttributeError(name)

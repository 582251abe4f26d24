"""everybyte: an LLM inference engine for agentic workloads."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy, so `import everybyte.formats` does not load the engine
    if name in ("LLM", "SamplingParams"):
        from everybyte.engine import llm, sampling_params
        return {"LLM": llm.LLM, "SamplingParams": sampling_params.SamplingParams}[name]
    raise AttributeError(name)

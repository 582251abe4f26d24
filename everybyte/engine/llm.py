"""The in-process API: LLM(...).generate(...) and .chat(...), vLLM-style."""
from __future__ import annotations

from typing import Iterator

from everybyte.engine.llm_engine import LLMEngine
from everybyte.engine.outputs import RequestOutput
from everybyte.engine.sampling_params import SamplingParams


class LLM(LLMEngine):
    """LLM(model=None, kv_cache_dtype="nvfp4", kv_cache_bytes="auto", dtype=None, block_size=16, expert_parallel=1,
    max_num_seqs=64, max_num_batched_tokens=512, max_model_len=None, device="cpu", seed=None).
    model=None is the embedded default model (SmolLM2-135M-Instruct); a path is a .gguf file or
    a Hugging Face directory; a LoadedModel is used as is."""

    def chat_prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        if not messages:
            raise ValueError("messages is empty")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             session_id: str | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c) for c in convs]
        return self.run_to_completion(self._make_all([p for p, _ in prompts], sampling_params,
                                                     [ids for _, ids in prompts], session_id, cache_salt))

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        text, ids = self.chat_prompt(messages)
        return self.stream(text, params, prompt_token_ids=ids)

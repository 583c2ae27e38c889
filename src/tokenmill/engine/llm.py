"""Offline API: ``LLM(model=...).generate(prompts, params)`` runs a batch to completion.

>>> from tokenmill import LLM, SamplingParams
>>> llm = LLM()                                    # the default model, SmolLM2-135M-Instruct
>>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
>>> out[0].text, out[0].token_ids, out[0].finish_reason
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import RequestOutput
from tokenmill.contracts.sampling import SamplingParams
from tokenmill.loader.resolve import DEFAULT_MODEL

if TYPE_CHECKING:
    from tokenmill.loader import LoadedModel

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]


class LLM:
    """A synchronous engine that generates for a list of prompts at once (continuous batching).

    Outputs are returned whole, so requests are not streamed: their decodes do not bound the
    prefill beside them (``decode_slowdown`` paces streamed server requests only) and a batch
    runs for throughput. ``engine_kwargs`` are :class:`~tokenmill.engine.config.EngineConfig` fields; ``loaded``
    reuses an already loaded model. With ``tensor_parallel_size=N`` the model runs on N worker
    processes; call :meth:`close` (or use the LLM as a context manager) to stop them.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, loaded: LoadedModel | None = None,
                 **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, session_ids: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order.

        ``params`` is one SamplingParams for all prompts or one per prompt (default: SamplingParams()).
        """
        batch = self._normalise_prompts(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} SamplingParams")
        sids = list(session_ids) if session_ids is not None else [None] * len(batch)
        if len(sids) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(sids)} session ids")
        token_lists = [self._encode(p) for p in batch]
        return self._run(token_lists, plist, sids)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several.

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts, rendered with the
        model's chat template (generation prompt added).
        """
        if not messages:
            raise ValueError("no messages given")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        token_lists = [self.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(token_lists, params)

    def close(self) -> None:
        """Write out queued pages of the storage cache tier and stop its worker thread; stop the
        worker ranks of ``tensor_parallel_size > 1``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode_chat(self, conversation: Sequence[Message]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"model {self.engine.model_name!r} has no chat template")
        text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _normalise_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        items = list(prompts)
        if not items:
            raise ValueError("no prompts given")
        if all(isinstance(x, int) for x in items):
            return [items]  # one prompt given as token ids
        for x in items:
            if not isinstance(x, str) and not (isinstance(x, Sequence) and all(isinstance(t, int) for t in x)):
                raise ValueError(f"a prompt must be a string or a list of token ids, got {type(x).__name__}")
        return items

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def _run(self, token_lists: list[list[int]], plist: list[SamplingParams],
             sids: list[str | None]) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        added: list[str] = []
        try:
            for rid, toks, p, sid in zip(ids, token_lists, plist, sids):
                engine.add_request(rid, toks, p, session_id=sid, streamed=False)   # whole outputs: throughput
                added.append(rid)
        except ValueError as e:
            for rid in added:
                engine.abort_request(rid)
            raise ValueError(f"prompt {len(added)}: {e}") from None
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in final:
                    engine.abort_request(rid)
            raise
        return [final[r] for r in ids]

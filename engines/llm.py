"""Offline batch generation: ``LLM(model=PATH).generate(prompts, params)``.

Structured output, logit bias and prompt log-probs are ``SamplingParams`` fields (``json_schema``,
``logit_bias``, ``prompt_logprobs``), as on the server.
"""

import weakref
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Self

from xinserve.engines.config import EngineConfig
from xinserve.engines.core.detokenizer import IncrementalDetokenizer
from xinserve.engines.core.engine import LLMEngine
from xinserve.engines.core.outputs import CompletionOutput, RequestOutput
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.lora.request import LoRARequest
from xinserve.engines.pooling.engine_step import add_pooling_request
from xinserve.engines.pooling.params import PoolingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, device: str = "cpu", **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        # close() once, on request, when this LLM is garbage-collected, or at exit: the finalizer holds
        # the engine's bound method (the engine), never the LLM, so it does not keep the LLM alive.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Stop the engine's other ranks and leave its process group (``tensor_parallel_size`` > 1), so
        that another engine can start in this process; also on leaving a ``with`` or when collected."""
        self._finalizer()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, in the KV pool and in the host tier (``kv_offloading_size``)."""
        self.engine.reset_prefix_cache()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) at once; results in prompt order. ``lora_request``:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), loaded on first use."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = [params or SamplingParams()] * len(prompts) if not isinstance(params, Seq) else params
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_request is not None:
            params_list = self._with_adapters(params_list, lora_request)
        results: dict[str, RequestOutput] = {}
        detokenizers: dict[tuple[str, int], IncrementalDetokenizer] = {}
        for prompt, p in zip(prompts, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, ids, p)
            results[request_id] = RequestOutput(
                request_id, ids, [CompletionOutput(i, [], "", None, [] if p.logprobs is not None else None)
                                  for i in range(p.n)],
            )
            for i in range(p.n):
                detokenizers[request_id, i] = IncrementalDetokenizer(
                    self.tokenizer, ids, p.stop, min_tokens=p.min_tokens,
                    include_stop_str_in_output=p.include_stop_str_in_output,
                )
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            for out in step.outputs:
                choice = results[out.request_id].outputs[out.index]
                if out.prompt_logprobs is not None:
                    results[out.request_id].prompt_logprobs = out.prompt_logprobs
                if out.kv_transfer_params is not None:
                    results[out.request_id].kv_transfer_params = out.kv_transfer_params
                detok = detokenizers[out.request_id, out.index]
                # The engine's own "stop" is always a stop token (EOS or stop_token_ids). A stop string
                # ends the output at its token, even inside a step's accepted drafts.
                _, stopped, kept = detok.add_each(out.new_token_ids, out.finished and out.finish_reason == "stop")
                choice.token_ids.extend(out.new_token_ids[:kept])
                if out.logprobs is not None:
                    choice.logprobs.extend(out.logprobs[:kept])
                if stopped and not out.finished:
                    self.engine.abort_request(out.request_id, out.index, len(choice.token_ids))
                if stopped or out.finished:
                    choice.finish_reason = "stop" if stopped else out.finish_reason
                    detok.flush()  # e.g. the bytes of a character the output ended in the middle of
                    choice.text = detok.text
            for failure in step.failures:  # the engine ended every choice of it
                self._fail(results[failure.request_id], failure.message, detokenizers)
        return list(results.values())

    def _with_adapters(self, params_list: Seq[SamplingParams],
                       lora_request: LoRARequest | Seq[LoRARequest | None]) -> list[SamplingParams]:
        """Each prompt's params naming its adapter, each adapter loaded on first use."""
        requests = [lora_request] * len(params_list) if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(requests) != len(params_list):
            raise ValueError(f"got {len(params_list)} prompts but {len(requests)} LoRA requests")
        for request in {r for r in requests if r is not None and r.lora_name not in self.engine.lora_names()}:
            self.engine.add_lora(request.lora_name, request.lora_path)
        return [p if r is None else replace(p, lora_name=r.lora_name) for p, r in zip(params_list, requests)]
    def encode(self, prompts: Prompt | Seq[Prompt], params: PoolingParams | None = None) -> list[list[float]]:
        """A pooling model's output for every prompt (text or token ids), in prompt order: an embedding
        (task embed) or the label probabilities / score (task classify). Raises ValueError for a prompt
        the engine refuses, RuntimeError for one that failed."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or PoolingParams(task=self.engine.pooler.spec.task if self.engine.pooler else "embed")
        outputs: dict[str, list[float] | None] = {}
        for prompt in prompts:
            request_id = str(self._counter)
            self._counter += 1
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            add_pooling_request(self.engine, request_id, ids, params)
            outputs[request_id] = None
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            for out in step.outputs:
                outputs[out.request_id] = out.pooled
            if step.failures:
                raise RuntimeError(f"request {step.failures[0].request_id} failed: {step.failures[0].message}")
        return list(outputs.values())

    def embed(self, prompts: Prompt | Seq[Prompt], dimensions: int | None = None) -> list[list[float]]:
        return self.encode(prompts, PoolingParams("embed", dimensions))

    def classify(self, prompts: Prompt | Seq[Prompt]) -> list[list[float]]:
        return self.encode(prompts, PoolingParams("classify"))

    @staticmethod
    def _fail(result: RequestOutput, message: str,
              detokenizers: dict[tuple[str, int], IncrementalDetokenizer]) -> None:
        """A failed request: its message on the result, its open choices ended with "abort"."""
        result.error = message
        for choice in result.outputs:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                detok = detokenizers[result.request_id, choice.index]
                detok.flush()
                choice.text = detok.text

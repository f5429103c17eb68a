"""`Engine`: the in-process API, a facade. Starts the scheduler, runner and detokenizer actors
over shared-memory rings (`start_engine`, actors/transport/topology.py) and serves every verb
through the frontend (actors/frontend/actor.py).

    with Engine("tiny", page_size=16) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        for chunk in engine.generate(prompt, stream=True): ...
        engine.pause_generation("retract"); engine.flush_cache(); engine.continue_generation()

`model_path=None` is SmolLM2-135M-Instruct (fetched once into the cache), "tiny" the generated
tiny Llama, else a model directory or a .gguf file. Every other keyword is a ServerArgs field.
Bad input raises ValueError naming the field and the limit before anything is sent, so the
engine keeps serving every other request. `ringserve serve` puts the IPC socket and HTTP on
the same frontend (actors/cli/serve.py).

The actor group is the supervisor's (actors/frontend/supervisor.py): when an actor dies it
starts them again and resubmits every request in flight (`supervise=False`: the engine ends,
every caller gets EngineDead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ringserve.actors.frontend.actor import TokenizerManager
from ringserve.actors.frontend.bridge import iterate_across, iterate_in_thread
from ringserve.actors.frontend.inputs import GenerateArgs
from ringserve.actors.frontend.journal import Journal
from ringserve.actors.frontend.supervisor import RestartPolicy, Supervisor
from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import messages as m
from ringserve.model.checkpoints.tokenizer import FastTokenizer

log = logging.getLogger("ringserve.engine")

READY_TIMEOUT_S = 900.0  # model load + compiling every bucket, on a slow CPU


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        from ringserve.actors.transport.devices import group_envs
        from ringserve.actors.transport.memory import resolve_memory
        from ringserve.actors.transport.topology import start_engine
        from ringserve.model.checkpoints.generation import read_sampling_defaults
        from ringserve.model.checkpoints.resolve import resolve_model
        from ringserve.model.checkpoints.tokenizer import load_encoder
        from ringserve.model.families import read_config

        self._closed = False
        args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        self.model_dir, tok_dir = resolve_model(args.model_path)
        # the KV pool's size, once: every actor (and every restart) gets this max_total_tokens
        args, self.kv_pool = resolve_memory(args, self.model_dir)
        self.args = args
        # The tokenizer loads while the actors start (each loads its own); the scheduler adds its
        # eos id to the model's. A GGUF's vocabulary is its tokenizer's: needed first. Once
        # transformers has loaded it, later starts encode with `tokenizers` alone (~0.2 s against
        # ~1.7 s of CPU) and load transformers' tokenizer, for chat templates, once serving.
        loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringserve-tokenizer")
        tokenizer = loading.submit(load_encoder, tok_dir)
        loading.shutdown(wait=False)
        mc = read_config(self.model_dir) if self.model_dir.is_dir() else None
        eos = set(mc.eos_token_ids if mc else ())
        self.vocab_size = mc.vocab_size if mc else len(tokenizer.result())
        self.served_model_name = args.served_model_name or self.model_dir.name
        # what a request leaves out samples with (`sampling_defaults`: the model's generation_config.json, or
        # the plain API defaults)
        self.sampling_defaults = read_sampling_defaults(self.model_dir) if args.sampling_defaults == "model" else {}

        envs = group_envs(args.dp_size, args.tp_size)  # each group's devices, once (a restart reuses them)

        def launch(model_dir: str, weights: m.StartWeights, on_failure):  # the actors, as the supervisor starts them
            cfgs = [m.encode(m.ActorConfig(args, model_dir, str(tok_dir), sorted(eos), self.vocab_size, weights, rank))
                    for rank in range(args.dp_size)]  # fmt: skip
            return start_engine(args, cfgs, on_failure, envs)

        def frontend() -> TokenizerManager:  # made while the actors start
            self._tok = tokenizer.result()
            self.frontend = TokenizerManager(self._tok, args=args, vocab_size=self.vocab_size,
                                             sampling_defaults=self.sampling_defaults)  # fmt: skip
            self.frontend.actor_pids = self.supervisor.pids
            self.frontend.runner_info = lambda: self.runner_info
            return self.frontend

        policy = RestartPolicy(args.max_restarts if args.restartable else 0, args.restart_window_s)
        journal = Journal(str(self.model_dir), args.lora_adapters if args.enable_lora else None)
        self.supervisor = Supervisor(None, launch, policy, journal, READY_TIMEOUT_S)
        try:
            self.supervisor.start(frontend)
            self.frontend.static_info = {"model_path": str(self.model_dir), "served_model_name": self.served_model_name,
                                         "max_total_num_tokens": (args.num_pages - 1) * args.page_size,
                                         "kv_pool": self.kv_pool.as_dict(),
                                         "default_sampling_params": dict(self.sampling_defaults)}  # fmt: skip
        except BaseException:
            self.shutdown()
            raise

    @property
    def tokenizer(self) -> Any:
        """transformers' tokenizer of the served model (the frontend encodes with `tokenizers`
        alone where it can, `FastTokenizer`: this then loads transformers' on first use)."""
        return self._tok.full if isinstance(self._tok, FastTokenizer) else self._tok

    @property
    def runner_info(self) -> dict[str, Any]:
        """The serving runner's ready info (devices, compiled programs, KV pool): the newest
        group's, after a restart."""
        from ringserve.actors.transport.topology import actor_name

        return json.loads(self.supervisor.ready.get(actor_name("runner", 0, self.args.dp_size)) or b"{}")

    @property
    def group(self):
        """The actor group serving now (the supervisor starts a new one after a crash)."""
        return self.supervisor.group

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                 stream: bool = False, session_params: dict | list[dict] | None = None,
                 logprob_start_len: int | list[int] = -1, token_ids_logprob: list | None = None,
                 lora_path: str | list[str | None] | None = None,
                 data_parallel_rank: int | list[int | None] | None = None,
                 return_hidden_states: bool | list[bool] = False,
                 return_routed_experts: bool | list[bool] = False, routed_experts_start_len: int | list[int] = 0,
                 cache_salt: str | list[str | None] | None = None) -> Any:  # fmt: skip
        """Generate for one prompt (a result dict) or many (a list, in order). stream=True returns
        an iterator of chunks with the text and ids so far (each with "index" when several
        requests were given), the last one of each request finished; leaving the iterator early
        aborts its unfinished requests.

        With return_logprob, SGLang's logprob fields: `logprob_start_len` (-1: the last prompt
        token; 0: the whole prompt) sets where `input_token_logprobs` begins (its first entry's
        logprob is None), `top_logprobs_num` adds the top-n at each position, `token_ids_logprob`
        (ids, or one list per prompt) the logprobs of those ids at every prompt and output position.

        `lora_path`: a loaded LoRA adapter's name (or one per prompt; None: the base model).
        `data_parallel_rank` (dp_size > 1) runs the request(s) in that group instead of the
        dispatcher's pick. `return_hidden_states` (a server started with
        enable_return_hidden_states): meta_info["hidden_states"], SGLang's: the last layer's state
        at each prompt position (one list), then at each output token's but the last.
        `return_routed_experts` (a MoE model served with enable_return_routed_experts):
        meta_info["routed_experts"], SGLang's routing replay: base64 of int32 [positions, MoE
        layers, top-k], the expert ids the forward routed positions [routed_experts_start_len,
        prompt + output - 1) to (`ringserve.actors.transport.routed.decode`). `cache_salt`
        (vLLM's): the prefix cache is shared only among requests of equal salts."""
        args = GenerateArgs(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, stream=stream,
                            session_params=session_params, logprob_start_len=logprob_start_len,
                            token_ids_logprob=token_ids_logprob, lora_path=lora_path,
                            data_parallel_rank=data_parallel_rank, return_hidden_states=return_hidden_states,
                            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len,
                            cache_salt=cache_salt)  # fmt: skip
        fe = self.frontend
        specs, batched = fe.specs(args)
        if stream:
            fe.check_up()
            return iterate_in_thread(fe.lt, lambda: fe.generate_stream(specs, batched))
        return fe.run_sync(fe.generate(specs, batched))

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                             top_logprobs_num: int | list[int] = 0, rid: str | list[str] | None = None,
                             stream: bool = False, session_params: dict | list[dict] | None = None,
                             logprob_start_len: int | list[int] = -1, token_ids_logprob: list | None = None,
                             lora_path: str | list[str | None] | None = None,
                             data_parallel_rank: int | list[int | None] | None = None,
                 return_hidden_states: bool | list[bool] = False,
                 return_routed_experts: bool | list[bool] = False, routed_experts_start_len: int | list[int] = 0,
                 cache_salt: str | list[str | None] | None = None) -> Any:  # fmt: skip
        """Like `generate`, on the caller's event loop: a result (or list), or with stream=True an
        async iterator of chunks. Cancelling the caller's task aborts its requests."""
        args = GenerateArgs(text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, stream=stream,
                            session_params=session_params, logprob_start_len=logprob_start_len,
                            token_ids_logprob=token_ids_logprob, lora_path=lora_path,
                            data_parallel_rank=data_parallel_rank, return_hidden_states=return_hidden_states,
                            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len,
                            cache_salt=cache_salt)  # fmt: skip
        fe = self.frontend
        specs, batched = fe.specs(args)
        if stream:
            fe.check_up()
            return self._astream(specs, batched)
        return await asyncio.wrap_future(fe.submit_threadsafe(fe.generate(specs, batched)))

    async def _astream(self, specs, batched: bool) -> AsyncIterator[dict]:
        fe = self.frontend
        async for chunk in iterate_across(fe.lt, lambda: fe.generate_stream(specs, batched)):
            yield chunk

    # ---- control ----------------------------------------------------------------------------
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (its partial output returns with finish_reason abort), the n
        samples `rid-0 ... rid-(n-1)` of a request made with n > 1, or every request."""
        fe = self.frontend

        async def abort() -> None:  # on the loop, which owns the request table
            fe.abort_request(rid, abort_all)

        fe.run_sync(abort())

    def pause_generation(self, mode: str = "abort") -> dict:
        """Returns when the scheduler is quiet: abort (every request finishes with 'abort'),
        retract (KV freed, requests wait) or in_place (everything kept)."""
        return self.frontend.run_sync(self.frontend.pause_generation(mode))

    def continue_generation(self) -> dict:
        return self.frontend.run_sync(self.frontend.continue_generation())

    def flush_cache(self) -> dict:
        """Empty the prefix cache and KV pools; refused (success False, with the reason) while a
        request holds KV."""
        return self.frontend.run_sync(self.frontend.flush_cache())

    def get_server_info(self) -> dict:
        return self.frontend.run_sync(self.frontend.get_server_info())

    def get_model_info(self) -> dict:
        """The served model: its path, name and the sampling defaults (`sampling_defaults`)."""
        return self.frontend.model_info()

    def wait_compiled(self, timeout: float = READY_TIMEOUT_S) -> dict:
        """Block until the runner has compiled every step program (it serves before that: see
        TokenizerManager.wait_compiled); the server info then. Call it before timing anything."""
        return self.frontend.run_sync(self.frontend.wait_compiled(timeout))

    # ---- streaming sessions -----------------------------------------------------------------
    def open_session(self, capacity_of_str_len: int = 0, session_id: str | None = None) -> str:
        """A streaming session; its turns are `generate(..., session_params={"id": session_id,
        "rid": the previous turn's id, ...})` and extend that turn's KV without recomputing it."""
        return self.frontend.run_sync(self.frontend.open_session(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        self.frontend.run_sync(self.frontend.close_session(session_id))

    # ---- the RL loop ------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **kw: Any) -> dict:
        """Load a checkpoint of the same architecture into the runner(s) without a restart or a
        recompilation; refused (success False, with the reason, old weights serving) while
        requests run unless paused, or for a missing / misshapen tensor or another
        architecture, or unless the engine serves `base_weight_version` (if given). Returns
        {"success", "message", "weight_version"}."""
        return self.frontend.run_sync(self.frontend.weights.update_weights_from_disk(model_path, weight_version, **kw))

    def update_weights_from_tensor(self, named_tensors: Any, weight_version: str | None = None, **kw: Any) -> dict:
        """HF-named NumPy, JAX or torch arrays (a dict, (name, array) pairs or a generator of
        them; a subset is fine), through shared memory in buckets of at most `bucket_bytes`
        (default 512 MiB); all or nothing. Deltas: a value `ringserve.Rows(start, array)` sends
        only those rows (the others kept), `mode="add"` adds each to the served value, and
        `base_weight_version` refuses the update unless the engine serves that version. Returns
        {"success", "message", "weight_version", "bytes"}. From another process:
        `Client.update_weights_from_tensor`."""
        return self.frontend.run_sync(self.frontend.weights.update_weights_from_tensor(named_tensors, weight_version, **kw))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> dict:
        """SGLang's: every runner joins a trainer's torch.distributed group (its rank 0 joins at
        the same time) as rank `rank_offset` + its index (data-parallel group x host). Needs
        torch (`pip install 'ringserve[torch]'`). Returns {"success", "message"}."""
        return self.frontend.run_sync(self.frontend.weights.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend))  # fmt: skip

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", **kw: Any) -> dict:
        """SGLang's: the tensors the trainer's rank 0 broadcasts over the group, in this order
        (flush_cache, abort_all_requests, weight_version as the other updates); all or nothing.
        Returns {"success", "message", "weight_version"}."""
        return self.frontend.run_sync(self.frontend.weights.update_weights_from_distributed(
            names, dtypes, shapes, group_name, **kw))  # fmt: skip

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.frontend.run_sync(self.frontend.weights.destroy_weights_update_group(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of a weight (HF name and layout) as served."""
        return self.frontend.run_sync(self.frontend.weights.get_weights_by_name(name, truncate_size))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Free the KV cache and / or the weights on the device (tags "kv_cache", "weights";
        None: both); generation waits until resume. Nothing is recompiled."""
        return self.frontend.run_sync(self.frontend.weights.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.frontend.run_sync(self.frontend.weights.resume_memory_occupation(tags))

    # ---- LoRA adapters ------------------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Load a PEFT adapter directory under `lora_name` while serving (no pause, nothing
        recompiles); requests name it with `lora_path=lora_name`. A bad adapter, a name taken
        or every slot taken: success False with the reason, the adapters before keep serving.
        Returns {"success", "error_message", "message", "loaded_adapters"}."""
        return self.frontend.run_sync(self.frontend.loras.load_lora_adapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unload an adapter; refused (success False) while a request uses it."""
        return self.frontend.run_sync(self.frontend.loras.unload_lora_adapter(lora_name))

    def get_load(self) -> dict:
        """{num_running_reqs, num_waiting_reqs, num_used_tokens, max_total_num_tokens, token_usage}
        (summed over the data-parallel groups)."""
        return self.frontend.run_sync(self.frontend.get_load())

    def get_loads(self) -> list[dict]:
        """One entry per data-parallel group: {dp_rank, num_reqs, num_waiting_reqs, num_tokens, ...}."""
        return self.frontend.run_sync(self.frontend.get_loads())

    def health(self) -> bool:
        """True while every actor is up and the scheduler answers."""
        return self.frontend.run_sync(self.frontend.health())

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        fe = getattr(self, "frontend", None)
        if fe is not None:
            fe.close()
        supervisor = getattr(self, "supervisor", None)
        if supervisor is not None:
            supervisor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

"""The runner's logic without its loop: the step messages applied to the slot mirrors, run on the
executor (model/runtime/executor.py), and the results and control replies built (actors/runner/actor.py
owns the ring loop).

One runner per host; it drives its host's devices through the `tp` mesh, which on many hosts
spans every host's (one jax.distributed program: every runner applies the same messages in the
same order, and a control verb that can fail commits only if every runner's succeeded,
model/runtime/distributed.py `all_ok`).
"""

from __future__ import annotations

import json
import time

import numpy as np

from ringserve.actors.runner.slot_mirrors import SlotMirrors
from ringserve.actors.runner.weight_group import UpdateGroups
from ringserve.actors.transport import messages as m
from ringserve.actors.transport import routed
from ringserve.actors.transport.trace import RunnerStamps
from ringserve.model.checkpoints.peft import parse_target_modules, read_adapter
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.distributed import all_ok
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor, StepOut
from ringserve.model.runtime.weight_sync import WeightSync


def executor_config(args) -> ExecutorConfig:
    """The executor's options: the server's compute section as it is, the program shapes the
    scheduler plans within too (ServerArgs.program_shapes), and the runner's own."""
    lora = args.lora
    return ExecutorConfig(
        compute=args.compute,
        shapes=args.program_shapes,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        precompile=args.precompile,
        background_compile=args.background_compile,
        lora_slots=lora.max_loras_per_batch + 1 if lora.enable_lora else 0,
        lora_rank=lora.max_lora_rank if lora.enable_lora else 0,
        lora_targets=parse_target_modules(lora.lora_target_modules) if lora.enable_lora else (),
        program_cache=True,  # CPU, one device: model/runtime/program_cache.py
    )


def ready_info(ex: ModelExecutor, load_s: float) -> dict:
    """What the runner tells the launcher once it serves (printed by `ringserve serve`)."""
    import jax

    devices = list(ex.mesh.devices.flat)
    mc = ex.model_config
    return {
        "platform": devices[0].platform,
        "devices": [str(d) for d in devices],
        "family": mc.family,
        "num_layers": mc.num_layers,
        "dtype": ex.plan.dtype,
        "attention_backend": ex.plan.attention,
        "matmul": ex.plan.dot.name,
        "quantization": ex.plan.quant,
        "num_programs": ex.num_programs,
        "programs_total": ex.num_programs_total,
        "load_and_compile_s": round(load_s, 2),
        "kv_pool_tokens": (ex.cfg.shapes.num_pages - 1) * ex.cfg.shapes.page_size,
        "jax_version": jax.__version__,
    }


class Pending:
    """A dispatched step whose samples are not fetched yet (JAX dispatch is asynchronous)."""

    __slots__ = ("step_id", "so", "rows", "k1", "t0", "want_top", "want_ids", "dev_rows")

    def __init__(self, step_id: int, so: StepOut, rows: int, k1: int, t0: float, want_top: bool, want_ids: bool,
                 dev_rows: list[DeviceRow]):  # fmt: skip
        self.step_id, self.so, self.rows, self.k1 = step_id, so, rows, k1
        self.t0, self.want_top, self.want_ids, self.dev_rows = t0, want_top, want_ids, dev_rows


class RunnerCore:
    def __init__(self, executor: ModelExecutor, max_slots: int, top_n: int, trace: bool = False,
                 groups: UpdateGroups | None = None):  # fmt: skip
        self.ex = executor
        self.mirrors = SlotMirrors(max_slots, local_space=executor.cfg.shapes.local_pages > 0)
        self.top_n = top_n
        self.weights = WeightSync(executor, all_ok)
        self.groups = groups or UpdateGroups(0, 600)  # the trainers' update groups joined (weight_group.py)
        self.stamps = RunnerStamps() if trace else None  # ServerArgs.step_trace (actors/transport/trace.py)

    def start_loras(self, adapters: dict[str, str]) -> None:
        """The start-up adapters (ServerArgs.lora_paths), in slots 1, 2, ... in their order (the
        scheduler's LoraTable numbers them the same way); a bad one fails the start (ValueError)."""
        for slot, (name, path) in enumerate(adapters.items(), start=1):
            self.load_lora(m.RunnerLora("load", name, slot, path))

    def load_lora(self, msg: m.RunnerLora) -> str:
        """Load (read and check the whole adapter, then write its slot) or unload (clear it)."""
        pool = self.ex.lora
        if pool is None:
            raise ValueError("this server serves no LoRA adapters (start it with enable_lora)")
        if msg.action == "unload":
            pool.clear(msg.slot)
            return f"unloaded LoRA adapter {msg.name!r} from slot {msg.slot}"
        try:
            adapter = read_adapter(msg.path, self.ex.model_config, pool.max_rank, pool.targets)
        except OSError as e:  # unreadable: a refusal like any other, never the runner's end
            raise ValueError(f"LoRA adapter {msg.path!r}: {e}") from None
        pool.write(msg.slot, adapter)
        return f"loaded LoRA adapter {msg.name!r} (rank {adapter.rank}) into slot {msg.slot}"

    def start_weights(self, w: m.StartWeights) -> str:
        """Apply the tensors a restarted engine serves over the checkpoint it loaded (all or
        nothing; WeightError fails the start, and the supervisor says why)."""
        return self.weights.stage(w.tensors, "restart", first=True, last=True)

    def control(self, msg: m.RunnerWeights | m.RunnerGetWeights | m.RunnerMemory | m.RunnerStatus | m.RunnerLora) -> m.RunnerReply:
        """A weights, adapter, memory or status message (every earlier step has been answered):
        its reply. A refusal (WeightError, a bad adapter, bad tags) leaves everything as it was."""
        try:
            if isinstance(msg, m.RunnerStatus):
                status = self.ex.compile_status() | {"trace_count": self.ex.trace_count}
                if self.ex.lora is not None:
                    status["lora_write_traces"] = self.ex.lora.write_traces
                return m.RunnerReply(True, "", json.dumps(status).encode())
            if isinstance(msg, m.RunnerLora):
                return m.RunnerReply(True, self.load_lora(msg))
            if isinstance(msg, m.RunnerWeights):
                u = msg.update
                if u.source == "disk":
                    text = self.weights.load_disk(u.model_path)
                elif u.source.startswith("group"):
                    text = self.update_group(u)
                elif u.source == "local":  # arrays handed over in this process (runner_in_process)
                    text = self.weights.load_local(u.update)
                elif u.source == "abandon":
                    self.weights.abandon(u.update)
                    text = f"abandoned {u.update}"
                else:
                    text = self.weights.stage(u.tensors, u.update, first=u.part == 0, last=u.part == u.parts - 1,
                                              mode=u.mode)  # fmt: skip
                return m.RunnerReply(True, text)
            if isinstance(msg, m.RunnerGetWeights):
                a = self.weights.get(msg.request.name, msg.request.truncate_size)
                return m.RunnerReply(True, "", m.f32(a.ravel()), list(a.shape))
            r = msg.request
            text = self.weights.release(r.tags) if r.action == "release" else self.weights.resume(r.tags)
            return m.RunnerReply(True, text)
        except ValueError as e:
            if isinstance(msg, m.RunnerWeights):
                self.weights.abandon()
            return m.RunnerReply(False, str(e))

    def update_group(self, u: m.UpdateWeightsReq) -> str:
        """Join, leave or receive an update over a trainer's update group; "group_drain" receives
        an update the scheduler refused and drops it (the trainer broadcasts regardless)."""
        g = u.group
        if g is None:
            raise ValueError(f"update_weights {u.source!r} names no group")
        if u.source == "group_init":
            return self.groups.join(g)
        if u.source == "group_destroy":
            return self.groups.leave(g.group_name)
        if u.source == "group_drain":
            self.groups.receive(g, keep=False)
            return f"received and dropped {len(g.names)} tensors"
        n = self.weights.apply(lambda: self.groups.receive(g), u.mode, on_device=self.groups.on_device(g.group_name))
        return f"updated {n} tensors from update group {g.group_name!r}"

    def dispatch(self, msg: m.StepMsg) -> Pending:
        t0 = time.perf_counter()
        dev_rows = self.mirrors.apply(msg)
        for st in msg.starts:  # a penalized request's token counts, before its first step
            if st.counts_ids:
                ids = m.as_i32(st.counts_ids)
                self.ex.start_counts(st.slot, ids[: st.counts_origin], ids[st.counts_origin :])
        t_applied = time.perf_counter()
        k1 = 1 + msg.drafts
        so = self.ex.run_step(dev_rows, k1 if msg.drafts else 0, msg.multistep)
        if self.stamps is not None:
            self.stamps.dispatched(msg.step_id, t0, t_applied, so.out.tokens)
        want_ids = any(r.logprob_ids is not None for r in dev_rows)
        want_top = self.top_n > 0 and any(r.sampling.top_logprobs for r in dev_rows)  # else zeros (not computed)
        return Pending(msg.step_id, so, len(dev_rows), k1, t0, want_top, want_ids, dev_rows)

    def _more(self, p: Pending, n: int) -> m.MoreLogprobs | None:
        """The step's token_ids_logprob (of its n samples) and prompt positions' logprobs, when
        some row wanted them (the host knows which: nothing is read back otherwise)."""
        npos, out, prompt = p.so.num_positions, p.so.out, p.so.prompt
        if not p.want_ids and not npos:
            return None
        more = m.MoreLogprobs(ids_n=out.ids_logprobs.shape[1] if p.want_ids else 0)
        if p.want_ids:
            more.ids_logprobs = m.f32(np.asarray(out.ids_logprobs)[:n])
        if npos:
            more.input_logprobs = m.f32(np.asarray(prompt.logprobs)[:npos])
            if p.want_top:
                more.input_top_ids = m.i32(np.asarray(prompt.top_ids)[:npos])
                more.input_top_logprobs = m.f32(np.asarray(prompt.top_logprobs)[:npos])
            if p.want_ids:
                more.input_ids_logprobs = m.f32(np.asarray(prompt.ids_logprobs)[:npos])
        return more

    def result(self, p: Pending) -> m.StepResultMsg:
        """The real rows' samples (the first rows * k1, row after row), for a verify step the
        drafts each round accepted, and the logprobs at the prompt positions the step wanted."""
        if self.stamps is not None:
            self.stamps.fetching(p.step_id)
        n, out = p.rows * p.k1, p.so.out
        tokens = np.asarray(out.tokens)[:n]  # blocks until the step is done
        res = m.StepResultMsg(p.step_id, m.i32(tokens), m.f32(np.asarray(out.logprobs)[:n]))
        if p.k1 > 1:
            res.accepted = m.i32(np.asarray(p.so.accepted)[: p.rows])
        if p.want_top:
            res.top_n = self.top_n
            res.top_ids = m.i32(np.asarray(out.top_ids)[:n])
            res.top_logprobs = m.f32(np.asarray(out.top_logprobs)[:n])
        res.more = self._more(p, n)
        if any(r.sampling.kept for r in p.dev_rows):
            self._kept(p, n, res)
        if any(r.sampling.hidden for r in p.dev_rows):
            self._hidden(p, res)
        if any(r.sampling.routed for r in p.dev_rows):
            self._routed(p, res)
        res.forward_s = time.perf_counter() - p.t0
        res.trace_count = self.ex.trace_count
        res.programs_compiled, res.programs_pending = self.ex.num_programs, self.ex.programs.pending
        res.compile_error = self.ex.programs.error or ""
        if self.stamps is not None:
            res.times = self.stamps.fetched(p.step_id)
        return res

    def _kept(self, p: Pending, n: int, res: m.StepResultMsg) -> None:
        """The ids each sample of the rows that asked was drawn from (unpacked from the step's
        bits, model/runtime/sampler.py), into `res`."""
        words = np.asarray(p.so.out.kept)[:n]
        vocab = self.ex.model_config.vocab_size
        counts, ids = np.zeros(n, np.int32), []
        for s in range(n):
            if p.dev_rows[s // p.k1].sampling.kept:
                kept = np.flatnonzero(np.unpackbits(words[s].view(np.uint8), bitorder="little")[:vocab])
                counts[s] = len(kept)
                ids.append(kept)
        res.kept_counts, res.kept_ids = m.i32(counts), m.i32(np.concatenate(ids)) if ids else b""

    def _hidden(self, p: Pending, res: m.StepResultMsg) -> None:
        """The last hidden states of every token of the rows that asked, into `res`."""
        if p.so.hidden is None or not p.so.hidden.shape[0]:
            raise ValueError("a row asks for hidden states, but the programs return none (enable_return_hidden_states)")
        h = np.asarray(p.so.hidden)
        rows, res.hidden_rows = _asked(p, h, [r.sampling.hidden for r in p.dev_rows])
        res.hidden, res.hidden_dim = m.f32(rows), h.shape[1]

    def _routed(self, p: Pending, res: m.StepResultMsg) -> None:
        """The routed expert ids of every token of the rows that asked, into `res`, in the
        narrowest integer their expert count allows (actors/transport/routed.py)."""
        if p.so.routed is None or not p.so.routed.shape[1]:
            raise ValueError("a row asks for routed experts, but the programs return none (enable_return_routed_experts)")
        ids, wire = np.asarray(p.so.routed), routed.wire_dtype(self.ex.model_config.num_experts)
        rows, res.routed_rows = _asked(p, ids, [r.sampling.routed for r in p.dev_rows])
        res.routed = rows.astype(wire).tobytes()
        res.routed_shape, res.routed_itemsize = (ids.shape[1], ids.shape[2]), wire.itemsize


def _asked(p: Pending, per_token: np.ndarray, take: list[bool]) -> tuple[np.ndarray, bytes]:
    """The tokens' rows of `per_token` ([T, ...], the step's tokens row after row) of the rows
    that asked (`take`), and each row's count of them on the wire (0 where it did not ask)."""
    lens = [r.extend_len for r in p.dev_rows]
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    rows = np.concatenate([per_token[starts[i] : starts[i + 1]] for i, t in enumerate(take) if t])
    return rows, m.i32([n if t else 0 for n, t in zip(lens, take, strict=True)])

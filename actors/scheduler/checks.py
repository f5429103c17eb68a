"""What a request may ask of this scheduler's server, checked when it is queued
(actors/scheduler/core.py `add_request`): a ValueError naming the field and the limit, before
the request holds anything. Its adapter and its grammar are bound by the core itself (the parts
that own them)."""

from __future__ import annotations

from ringserve.actors.scheduler.req import Req
from ringserve.actors.server_args import ServerArgs
from ringserve.model.compute.step_inputs import BAN_IDS


def check_request(args: ServerArgs, req: Req) -> None:
    """Hidden states and routed experts only where the server returns them and never on a
    session's turn (its earlier turns' KV is reused, their positions never computed again);
    the routed experts' start within the prompt; min_new_tokens holding back no more ids than
    the programs can ban."""
    if req.return_hidden_states:
        if not args.enable_return_hidden_states:
            raise ValueError(
                "return_hidden_states: this server returns none (start it with enable_return_hidden_states)"
            )
        if req.session_id is not None:
            raise ValueError(
                "return_hidden_states: not with a session turn (its earlier turns' KV is reused)"
            )
    if req.routed is not None:
        if not args.enable_return_routed_experts:
            raise ValueError(
                "return_routed_experts: this server returns none (start it with enable_return_routed_experts)"
            )
        if req.session_id is not None:
            raise ValueError(
                "return_routed_experts: not with a session turn (its earlier turns' KV is reused)"
            )
        if not 0 <= req.routed.first <= req.origin_len:
            raise ValueError(f"routed_experts_start_len={req.routed.first}: must be in [0, {req.origin_len}] "
                             "(the prompt's length)")  # fmt: skip
    if req.sampling.min_new_tokens and len(req.sampling.held_back(req.eos_ids)) > BAN_IDS:
        raise ValueError(f"min_new_tokens: EOS ids and stop_token_ids together are more than the {BAN_IDS} the "
                         "programs hold back")  # fmt: skip

"""The detokenizer actor: the ring loop around `DetokenizerCore` (actors/detokenizer/core.py).

Token outputs from the scheduler come in as BatchTokenOut and leave for the frontend as
BatchStrOut (the same outputs with their new text); control replies from the scheduler pass
through unchanged, in order.
"""

from __future__ import annotations

import logging

from ringserve.actors.detokenizer.core import DetokenizerCore
from ringserve.actors.transport import messages as m

log = logging.getLogger("ringserve.detokenizer")


def serve(core: DetokenizerCore, inbox, outbox, stopping) -> None:
    while not stopping():
        raw = inbox.recv(timeout=0.5)
        if raw is None:
            continue
        msg = m.to_detokenizer.decode(raw)
        if isinstance(msg, m.BatchTokenOut):
            outbox.send(m.encode(core.convert(msg)))
            while core.dropped:
                log.error("output for unknown request %s dropped", core.dropped.pop())
        else:
            outbox.send(raw)  # a ControlReply, passed through as is


def run(ctx) -> None:
    """Actor entry point: rings `inbox` (from the scheduler) and `outbox` (to the frontend)."""
    from ringserve.actors.transport.ring import Ring
    from ringserve.model.checkpoints.tokenizer import load_decoder

    cfg = m.actor_config.decode(ctx.config)
    tok = load_decoder(cfg.tokenizer_dir)  # `tokenizers` alone once cached (model/checkpoints/tokenizer.py)
    inbox = Ring.attach(ctx.rings["inbox"], spin_us=cfg.args.spin_us)
    outbox = Ring.attach(ctx.rings["outbox"], spin_us=cfg.args.spin_us)
    ctx.ready()
    serve(DetokenizerCore(tok), inbox, outbox, ctx.stopping)

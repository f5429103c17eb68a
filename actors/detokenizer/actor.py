"""The detokenizer actor: token ids in, text deltas out, per request (actors/detok_core.py).

Each TokenOut carries only the ids produced since the previous one; nothing is resent. A
request's first TokenOut opens its decoder (stop strings, special-token options); its last
closes it. Control replies from the scheduler pass through unchanged, in order.
"""

from __future__ import annotations

import logging

from actors.detokenizer.streams import DetokenizerCore
from actors.transport import messages as m

log = logging.getLogger("ringserve.detokenizer")


class Detokenizer:
    def __init__(self, tokenizer):
        self.core = DetokenizerCore(tokenizer)

    def convert(self, batch: m.BatchTokenOut) -> m.BatchStrOut:
        outs, texts = [], []
        for t in batch.outs:
            if t.open is not None:
                sp = t.open
                self.core.open(t.rid, stops=sp.stop, no_stop_trim=sp.no_stop_trim,
                               skip_special_tokens=sp.skip_special_tokens,
                               spaces_between_special_tokens=sp.spaces_between_special_tokens)  # fmt: skip
            if t.rid not in self.core.states:
                log.error("output for unknown request %s dropped", t.rid)
                continue
            matched = None
            if t.finished and t.finish_reason and isinstance(t.finish_reason.get("matched"), str):
                matched = t.finish_reason["matched"]
            texts.append(self.core.push(t.rid, m.as_i32(t.new_ids).tolist(), t.finished, matched))
            t.open = None  # the frontend has no use for it
            outs.append(t)
        return m.BatchStrOut(outs, texts)

    def serve(self, inbox, outbox, stopping) -> None:
        while not stopping():
            raw = inbox.recv(timeout=0.5)
            if raw is None:
                continue
            msg = m.to_detokenizer.decode(raw)
            if isinstance(msg, m.BatchTokenOut):
                outbox.send(m.encode(self.convert(msg)))
            else:
                outbox.send(raw)  # a ControlReply, passed through as is


def run(ctx) -> None:
    """Actor entry point: rings `inbox` (from the scheduler) and `outbox` (to the frontend)."""
    from actors.transport.ring import Ring
    from model.checkpoints.tokenizer import load_tokenizer

    cfg = m.actor_config.decode(ctx.config)
    tok = load_tokenizer(cfg.tokenizer_dir)
    inbox = Ring.attach(ctx.rings["inbox"], spin_us=cfg.args.spin_us)
    outbox = Ring.attach(ctx.rings["outbox"], spin_us=cfg.args.spin_us)
    ctx.ready()
    Detokenizer(tok).serve(inbox, outbox, ctx.stopping)
